# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A drafter with attention layers of its own keeps the engine's quantized KV
cache dtype beside a sparse MLA target, whose layers write their backend's
layout (fp8_ds_mla) into the cache config they share."""

import json
from pathlib import Path
from unittest import mock

import pytest

import vllm.triton_utils
from vllm.engine.arg_utils import EngineArgs

DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 512,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "vocab_size": 129280,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
LLAMA_DRAFT = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 129280,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def make_config(tmp_path: Path):
    """The engine config of `target` with a KV cache of `kv_cache_dtype` and a
    drafter (default: a one-layer Llama draft model)."""
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(LLAMA_DRAFT))

    def make(
        target=DEEPSEEK_V32, kv_cache_dtype="fp8", spec_kv_cache_dtype=None, **spec_args
    ):
        (tmp_path / "target").mkdir(exist_ok=True)
        (tmp_path / "target" / "config.json").write_text(json.dumps(target))
        spec = {"method": "draft_model", "model": str(tmp_path / "draft")} | spec_args
        if spec_kv_cache_dtype is not None:
            spec["kv_cache_dtype"] = spec_kv_cache_dtype
        engine_args = EngineArgs(
            model=str(tmp_path / "target"),
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            kv_cache_dtype=kv_cache_dtype,
            speculative_config=spec | {"num_speculative_tokens": 1},
        )
        return engine_args.create_engine_config()

    # The CPU platform wants triton-cpu on x86, for its model runner only.
    with mock.patch.object(vllm.triton_utils, "HAS_TRITON", True):
        yield make


def test_draft_model_keeps_fp8_after_the_target_writes_fp8_ds_mla(make_config):
    vllm_config = make_config()
    # What a FLASHMLA_SPARSE target layer writes back (MLAAttention).
    vllm_config.cache_config.cache_dtype = "fp8_ds_mla"
    draft_config = vllm_config.speculative_config.apply_draft_overrides(vllm_config)
    assert draft_config.cache_config.cache_dtype == "fp8"


@pytest.mark.parametrize(
    ("engine_args", "draft_dtype"),
    [
        ({"spec_kv_cache_dtype": "auto"}, "auto"),
        ({"kv_cache_dtype": "auto"}, None),
        ({"target": LLAMA_DRAFT}, None),
        (
            {
                "target": DEEPSEEK_V32 | {"num_nextn_predict_layers": 1},
                "method": "mtp",
                "model": None,
            },
            None,
        ),
        ({"method": "ngram", "prompt_lookup_max": 2, "model": None}, None),
    ],
    ids=["draft-names-auto", "bf16-cache", "dense-target", "mtp", "ngram"],
)
def test_other_drafters_keep_their_setting(make_config, engine_args, draft_dtype):
    spec_config = make_config(**engine_args).speculative_config
    assert spec_config.kv_cache_dtype == draft_dtype
