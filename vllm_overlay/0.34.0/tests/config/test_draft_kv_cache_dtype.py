# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A drafter whose attention is not MLA keeps the user's KV cache dtype when a
sparse MLA target layer writes its backend's layout (fp8_ds_mla) into the
cache config they share."""

import json
from pathlib import Path

import pytest

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

    return make


def _target_layer_on_flashmla_sparse(vllm_config, monkeypatch) -> None:
    """Builds DeepSeek-V3.2's MLA attention as on Hopper, where selection gives
    FLASHMLA_SPARSE; its impl, which needs a GPU, is left out."""
    import torch

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.mla.flashmla_sparse import (
        FlashMLASparseBackend,
    )

    class NoGpuImpl:
        is_sparse = True
        supports_dense_mha_prefill = False
        dcp_world_size = pcp_world_size = 1

        def __init__(self, **kwargs) -> None:
            pass

    monkeypatch.setattr(FlashMLASparseBackend, "get_impl_cls", lambda: NoGpuImpl)
    monkeypatch.setattr(
        mla_attention, "get_attn_backend", lambda *a, **k: FlashMLASparseBackend
    )
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(torch.bfloat16),
        torch.device("meta"),
    ):
        mla_attention.MLAAttention(
            num_heads=16,
            scale=1.0,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            q_lora_rank=512,
            kv_lora_rank=512,
            kv_b_proj=torch.nn.Linear(512, 16 * 256, bias=False),
            cache_config=vllm_config.cache_config,
            prefix="model.layers.0.self_attn.attn",
            use_sparse=True,
        )


def test_draft_model_keeps_fp8_when_the_target_writes_fp8_ds_mla(
    make_config, monkeypatch
):
    vllm_config = make_config()
    _target_layer_on_flashmla_sparse(vllm_config, monkeypatch)
    assert vllm_config.cache_config.cache_dtype == "fp8_ds_mla"
    draft_config = vllm_config.speculative_config.apply_draft_overrides(vllm_config)
    assert draft_config.cache_config.cache_dtype == "fp8"


@pytest.mark.parametrize(
    ("engine_args", "draft_dtype"),
    [
        ({"spec_kv_cache_dtype": "auto"}, "auto"),
        ({"kv_cache_dtype": "auto"}, None),
        (
            {
                "target": DEEPSEEK_V32 | {"num_nextn_predict_layers": 1},
                "method": "mtp",
                "model": None,
            },
            None,
        ),
        ({"method": "ngram", "prompt_lookup_max": 2, "model": None}, None),
        ({"method": "suffix", "model": None}, None),
    ],
    ids=["draft-names-auto", "bf16-cache", "mtp", "ngram", "suffix"],
)
def test_other_drafters_keep_their_setting(
    make_config, monkeypatch, engine_args, draft_dtype
):
    try:
        vllm_config = make_config(**engine_args)
    except ImportError as exc:  # suffix decoding's package, where it is needed
        pytest.skip(str(exc))
    _target_layer_on_flashmla_sparse(vllm_config, monkeypatch)
    assert vllm_config.speculative_config.kv_cache_dtype == draft_dtype
