# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5.3-Flash's sparse MLA layer built through vLLM's selection on Hopper:
a quantized KV cache stores FlashMLA's fp8_ds_mla rows, as DeepSeek-V3.2's."""

import json
from types import SimpleNamespace

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention import mla_attention
from vllm.platforms import current_platform
from vllm.utils.flashinfer import has_flashinfer_sm90_nope_mla
from vllm.utils.torch_utils import set_default_torch_dtype

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda(), reason="CUDA attention selection"
)


class _NoGpuImpl(SimpleNamespace):
    is_sparse, supports_dense_mha_prefill = True, False
    dcp_world_size = pcp_world_size = 1


@pytest.fixture
def glm_mla_selection(tmp_path, monkeypatch):
    """Builds GLM-5.3-Flash's MLA attention (head size 512 + `qk_rope_head_dim`)
    on SM90 with the given engine arguments; returns its backend, its cache
    dtype and the warnings naming fp8_ds_mla. Only kernels are left out."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import _cached_get_attn_backend

    class Sm90(CudaPlatform):  # type: ignore[valid-type, misc]
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(9, 0)

    monkeypatch.setattr("vllm.platforms._current_platform", Sm90())
    for name in ("FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90"):
        backend = AttentionBackendEnum[name].get_class()
        monkeypatch.setattr(backend, "get_impl_cls", lambda: _NoGpuImpl)
    warnings: list[str] = []
    monkeypatch.setattr(
        mla_attention.logger,
        "warning_once",
        lambda msg, *args: "fp8_ds_mla" in msg and warnings.append(msg % args),
    )
    glm = {"architectures": ["Glm5NextForCausalLM"], "model_type": "glm5_next"}
    (tmp_path / "config.json").write_text(json.dumps(glm | {"mla_use_nope": True}))

    def build(qk_rope_head_dim=0, **engine_args):
        args = EngineArgs(str(tmp_path), enable_prefix_caching=False, **engine_args)
        config = args.create_engine_config()
        _cached_get_attn_backend.cache_clear()
        with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
            layer = mla_attention.MLAAttention(
                num_heads=64,
                scale=1.0,
                qk_nope_head_dim=256,
                qk_rope_head_dim=qk_rope_head_dim,
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
    backend, stored, (warning,) = glm_mla_selection(kv_cache_dtype=kv_cache_dtype)
    assert (backend, stored) == ("FLASHMLA_SPARSE", "fp8_ds_mla")
    assert f"--kv-cache-dtype {kv_cache_dtype} " in warning
    assert "--attention-backend FLASHINFER_MLA_SPARSE_SM90 keeps" in warning


FLASHINFER = "FLASHINFER_MLA_SPARSE_SM90"
# --kv-cache-dtype, --attention-backend, qk_rope_head_dim: backend, stored dtype
OTHER_PATHS = {
    "bf16": ("auto", None, 0, FLASHINFER, "auto"),
    "explicit-flashinfer": ("fp8", FLASHINFER, 0, FLASHINFER, "fp8"),
    "576-fp8": ("fp8", None, 64, "FLASHMLA_SPARSE", "fp8_ds_mla"),
    "576-fp8_e4m3": ("fp8_e4m3", None, 64, FLASHINFER, "fp8_e4m3"),
}


@pytest.mark.skipif(not has_flashinfer_sm90_nope_mla(), reason="FlashInfer SM90")
@pytest.mark.parametrize(
    ("kv_cache_dtype", "attention_backend", "rope", "backend", "stored"),
    list(OTHER_PATHS.values()),
    ids=list(OTHER_PATHS),
)
def test_other_paths_keep_their_rows_without_warning(
    glm_mla_selection, kv_cache_dtype, attention_backend, rope, backend, stored
):
    selected = glm_mla_selection(
        rope, kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend
    )
    assert selected == (backend, stored, [])
