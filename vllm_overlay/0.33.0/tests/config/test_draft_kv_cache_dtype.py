# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A drafter whose attention is not MLA keeps the user's KV cache dtype when a
sparse MLA layer writes fp8_ds_mla into the cache config they share."""

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention import mla_attention
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
}
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=129280)


class _NoGpuImpl(SimpleNamespace):
    is_sparse, supports_dense_mha_prefill = True, False
    dcp_world_size = pcp_world_size = 1


@pytest.fixture
def build_target(tmp_path, monkeypatch):
    """DeepSeek-V3.2's engine config with a `cache` KV cache and a drafter (default a
    Llama draft model) once its MLA layer is built on FLASHMLA_SPARSE, as on Hopper."""
    monkeypatch.setattr(FlashMLASparseBackend, "get_impl_cls", lambda: _NoGpuImpl)
    monkeypatch.setattr(
        mla_attention, "get_attn_backend", lambda *a, **k: FlashMLASparseBackend
    )
    for name, config in (("target", DEEPSEEK_V32), ("draft", LLAMA)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))

    def build(cache="fp8", **spec):
        spec = {"method": "draft_model", "model": str(tmp_path / "draft")} | spec
        config = EngineArgs(
            str(tmp_path / "target"),
            enable_prefix_caching=False,
            kv_cache_dtype=cache,
            speculative_config=spec | {"num_speculative_tokens": 1},
        ).create_engine_config()
        with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
            mla_attention.MLAAttention(
                num_heads=16,
                scale=1.0,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                q_lora_rank=512,
                kv_lora_rank=512,
                kv_b_proj=torch.nn.Linear(512, 16 * 256, bias=False),
                cache_config=config.cache_config,
                prefix="model.layers.0.self_attn.attn",
                use_sparse=True,
            )
        return config

    return build


def test_draft_model_keeps_fp8_when_the_target_writes_fp8_ds_mla(build_target):
    config = build_target()
    assert config.cache_config.cache_dtype == "fp8_ds_mla"
    draft = config.speculative_config.apply_draft_overrides(config)
    assert draft.cache_config.cache_dtype == "fp8"


# build_target's arguments: the drafter's own kv_cache_dtype afterwards
OTHER_DRAFTERS: dict[str, tuple[dict[str, Any], str | None]] = {
    "draft-names-auto": ({"kv_cache_dtype": "auto"}, "auto"),
    "bf16-cache": ({"cache": "auto"}, None),
    "mtp": ({"method": "mtp", "model": None}, None),
    "suffix": ({"method": "suffix", "model": None}, None),
}


@pytest.mark.parametrize("case", list(OTHER_DRAFTERS))
def test_other_drafters_keep_their_setting(build_target, case):
    args, draft_dtype = OTHER_DRAFTERS[case]
    try:
        config = build_target(**args)
    except ImportError as exc:  # suffix decoding's package, where it is needed
        pytest.skip(str(exc))
    assert config.speculative_config.kv_cache_dtype == draft_dtype


def test_explicit_fp8_ds_mla_with_a_draft_model_is_refused(build_target):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_ds_mla is a layout"):
        build_target(cache="fp8_ds_mla")
