# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5.3-Flash's sparse MLA layer on Hopper: a quantized KV cache selects
FLASHMLA_SPARSE and its fp8_ds_mla rows, as DeepSeek-V3.2's does; BF16 and
an explicit FlashInfer backend keep FlashInfer's rows."""

import json
from pathlib import Path

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention import mla_attention
from vllm.platforms import current_platform
from vllm.utils.flashinfer import (
    has_flashinfer_sm90_nope_mla,
    has_flashinfer_sparse_mla_sm120,
)
from vllm.utils.torch_utils import set_default_torch_dtype

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(), reason="CUDA attention selection"
)
needs_flashinfer = pytest.mark.skipif(
    not has_flashinfer_sm90_nope_mla(), reason="FlashInfer's SM90 MLA"
)

GLM5_FLASH = {
    "architectures": ["Glm5NextForCausalLM"],
    "model_type": "glm5_next",
    "dtype": "bfloat16",
    "mla_use_nope": True,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
}


class _NoGpuImpl:
    is_sparse = True
    supports_dense_mha_prefill = False
    dcp_world_size = pcp_world_size = 1

    def __init__(self, **kwargs) -> None:
        pass


@pytest.fixture
def glm_mla_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Builds GLM-5.3-Flash's MLA attention (head size 512, no RoPE; 576 with
    `qk_rope_head_dim=64`, as DeepSeek-V3.2's) through
    vLLM's selection on an SM90 GPU with the given engine arguments; returns
    the layer and its warnings about fp8_ds_mla rows. Only the backends' GPU
    kernels are left out."""
    import vllm.platforms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import _cached_get_attn_backend

    capability = DeviceCapability(9, 0)

    class CudaGpu(CudaPlatform):  # type: ignore[valid-type, misc]
        @classmethod
        def get_device_capability(cls, device_id=0):
            return capability

    monkeypatch.setattr(vllm.platforms, "_current_platform", CudaGpu())

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for backend in (
        "FLASHMLA_SPARSE",
        "FLASHINFER_MLA_SPARSE_SM90",
        "FLASHINFER_MLA_SPARSE_SM120",
    ):
        backend_cls = AttentionBackendEnum[backend].get_class()
        monkeypatch.setattr(backend_cls, "get_impl_cls", lambda: _NoGpuImpl)
    (tmp_path / "config.json").write_text(json.dumps(GLM5_FLASH))
    warnings: list[str] = []  # those about fp8_ds_mla rows

    def warning_once(msg: str, *args) -> None:
        if "fp8_ds_mla" in msg % args:
            warnings.append(msg % args)

    monkeypatch.setattr(mla_attention.logger, "warning_once", warning_once)

    def build(qk_rope_head_dim=0, sm=90, **engine_args):
        nonlocal capability
        capability = DeviceCapability(sm // 10, sm % 10)
        _cached_get_attn_backend.cache_clear()
        args = EngineArgs(
            str(tmp_path),
            load_format="dummy",
            skip_tokenizer_init=True,
            enable_prefix_caching=False,
            **engine_args,
        )
        vllm_config = args.create_engine_config()
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(torch.bfloat16),
            torch.device("meta"),
        ):
            layer = mla_attention.MLAAttention(
                num_heads=64,
                scale=1.0,
                qk_nope_head_dim=256,
                qk_rope_head_dim=qk_rope_head_dim,
                v_head_dim=256,
                q_lora_rank=1536,
                kv_lora_rank=512,
                kv_b_proj=torch.nn.Linear(512, 64 * 512, bias=False),
                cache_config=vllm_config.cache_config,
                prefix="model.layers.3.self_attn.attn",
                use_sparse=True,
            )
        _cached_get_attn_backend.cache_clear()
        return layer, warnings

    return build


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_quantized_cache_stores_fp8_ds_mla_rows(glm_mla_layer, kv_cache_dtype):
    layer, warnings = glm_mla_layer(kv_cache_dtype=kv_cache_dtype)
    assert layer.attn_backend.get_name() == "FLASHMLA_SPARSE"
    assert layer.kv_cache_dtype == "fp8_ds_mla"
    (warning,) = warnings
    assert f"--kv-cache-dtype {kv_cache_dtype} " in warning
    assert "--attention-backend FLASHINFER_MLA_SPARSE_SM90 keeps" in warning


@needs_flashinfer
def test_bf16_cache_stays_on_flashinfer(glm_mla_layer):
    layer, warnings = glm_mla_layer(kv_cache_dtype="auto")
    assert layer.attn_backend.get_name() == "FLASHINFER_MLA_SPARSE_SM90"
    assert (layer.kv_cache_dtype, warnings) == ("auto", [])


@needs_flashinfer
def test_flashinfer_backend_keeps_per_tensor_fp8_rows(glm_mla_layer):
    layer, warnings = glm_mla_layer(
        kv_cache_dtype="fp8", attention_backend="FLASHINFER_MLA_SPARSE_SM90"
    )
    assert layer.attn_backend.get_name() == "FLASHINFER_MLA_SPARSE_SM90"
    assert (layer.kv_cache_dtype, warnings) == ("fp8", [])


def test_fp8_at_head_size_576_has_no_nope_warning(glm_mla_layer):
    """DeepSeek-V3.2's 576-wide latent stored fp8 as fp8_ds_mla before."""
    layer, warnings = glm_mla_layer(qk_rope_head_dim=64, kv_cache_dtype="fp8")
    assert layer.attn_backend.get_name() == "FLASHMLA_SPARSE"
    assert (layer.kv_cache_dtype, warnings) == ("fp8_ds_mla", [])


@pytest.mark.skipif(
    not has_flashinfer_sparse_mla_sm120(), reason="FlashInfer's SM120 sparse MLA"
)
def test_fp8_on_sm120_has_no_hopper_warning(glm_mla_layer):
    """SM120's sparse backend stored fp8 as fp8_ds_mla before."""
    layer, warnings = glm_mla_layer(sm=120, kv_cache_dtype="fp8")
    assert layer.attn_backend.get_name() == "FLASHINFER_MLA_SPARSE_SM120"
    assert (layer.kv_cache_dtype, warnings) == ("fp8_ds_mla", [])
