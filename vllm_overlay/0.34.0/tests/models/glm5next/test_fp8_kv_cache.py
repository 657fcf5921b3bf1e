# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5.3-Flash's sparse MLA layer on Hopper: fp8_ds_mla for a quantized cache."""

import json
from types import SimpleNamespace

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention import mla_attention
from vllm.platforms import current_platform
from vllm.utils import flashinfer
from vllm.utils.torch_utils import set_default_torch_dtype

pytestmark = pytest.mark.skipif(not current_platform.is_cuda(), reason="CUDA selection")
FLASHINFER, SM120 = "FLASHINFER_MLA_SPARSE_SM90", "FLASHINFER_MLA_SPARSE_SM120"


class _NoGpuImpl(SimpleNamespace):
    is_sparse, supports_dense_mha_prefill = True, False
    dcp_world_size = pcp_world_size = 1


@pytest.fixture
def glm_mla_selection(tmp_path, monkeypatch):
    """GLM-5.3-Flash's MLA attention (head size 512 + `rope`) built on compute
    capability `sm`, without kernels: its backend, cache dtype and warnings."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import _cached_get_attn_backend

    class Gpu(CudaPlatform):  # type: ignore[valid-type, misc]
        capability = DeviceCapability(9, 0)
        get_device_capability = classmethod(lambda cls, device_id=0: cls.capability)

    def warning_once(msg: str, *args) -> None:
        if "fp8_ds_mla" in msg:
            warnings.append(msg % args)

    monkeypatch.setattr("vllm.platforms._current_platform", Gpu())
    for name in ("FLASHMLA_SPARSE", FLASHINFER, SM120):
        backend = AttentionBackendEnum[name].get_class()
        monkeypatch.setattr(backend, "get_impl_cls", lambda: _NoGpuImpl)
    warnings: list[str] = []
    monkeypatch.setattr(mla_attention.logger, "warning_once", warning_once)
    glm = {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next"}
    (tmp_path / "config.json").write_text(json.dumps(glm | {"mla_use_nope": True}))

    def build(rope=0, sm=90, **engine_args):
        Gpu.capability = DeviceCapability(*divmod(sm, 10))
        args = EngineArgs(str(tmp_path), enable_prefix_caching=False, **engine_args)
        config = args.create_engine_config()
        _cached_get_attn_backend.cache_clear()
        with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
            layer = mla_attention.MLAAttention(
                num_heads=64,
                scale=1.0,
                qk_nope_head_dim=256,
                qk_rope_head_dim=rope,
                v_head_dim=256,
                q_lora_rank=1536,
                kv_lora_rank=512,
                kv_b_proj=torch.nn.Linear(512, 64 * 512, bias=False),
                cache_config=config.cache_config,
                prefix="model.layers.3.self_attn.attn",
                use_sparse=True,
            )
        return layer.attn_backend.get_name(), layer.kv_cache_dtype, warnings

    return build


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_quantized_cache_stores_fp8_ds_mla_rows(glm_mla_selection, kv_cache_dtype):
    backend, stored, warnings = glm_mla_selection(kv_cache_dtype=kv_cache_dtype)
    assert (backend, stored) == ("FLASHMLA_SPARSE", "fp8_ds_mla")
    (warning,) = warnings
    assert f"--kv-cache-dtype {kv_cache_dtype} " in warning
    assert "--attention-backend FLASHINFER_MLA_SPARSE_SM90 keeps" in warning


# --kv-cache-dtype, --attention-backend, rope dims, SM: backend, stored dtype
OTHER_PATHS = {
    "bf16": ("auto", None, 0, 90, FLASHINFER, "auto"),
    "explicit-flashinfer": ("fp8", FLASHINFER, 0, 90, FLASHINFER, "fp8"),
    "576-fp8": ("fp8", None, 64, 90, "FLASHMLA_SPARSE", "fp8_ds_mla"),
    "576-fp8_e4m3": ("fp8_e4m3", None, 64, 90, FLASHINFER, "fp8_e4m3"),
    "sm120": ("fp8", None, 0, 120, SM120, "fp8_ds_mla"),
}


@pytest.mark.skipif(
    not flashinfer.has_flashinfer_sm90_nope_mla(), reason="FlashInfer SM90"
)
@pytest.mark.parametrize("case", list(OTHER_PATHS))
def test_other_paths_keep_their_rows_without_warning(glm_mla_selection, case):
    kv_cache_dtype, flag, rope, sm, backend, stored = OTHER_PATHS[case]
    if sm == 120 and not flashinfer.has_flashinfer_sparse_mla_sm120():
        pytest.skip("FlashInfer SM120")
    selected = glm_mla_selection(
        rope, sm, kv_cache_dtype=kv_cache_dtype, attention_backend=flag
    )
    assert selected == (backend, stored, [])
