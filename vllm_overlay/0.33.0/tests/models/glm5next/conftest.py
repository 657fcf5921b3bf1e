# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import json
from types import SimpleNamespace

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.layers.attention import mla_attention
from vllm.models.glm5next.common.model import Glm5NextDecoderLayer
from vllm.utils.torch_utils import set_default_torch_dtype

# What GLM-5.3-Flash's layers read from its config.json beyond transformers' defaults.
GLM5_FLASH_CONFIG = {
    "architectures": ["Glm5NextForCausalLM"],
    "model_type": "glm5_next",
    "mla_use_nope": True,
    "indexer_rope_interleave": True,
    "index_kpool": 4,
    "mhc": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
}


# The sparse MLA attention backend that only a GPU has, and its impl.
class _NoGpuMLA(SimpleNamespace):
    is_sparse, supports_dense_mha_prefill, dcp_world_size = True, False, 1
    get_name = staticmethod(lambda: "NO_GPU_SPARSE_MLA")
    is_mla = staticmethod(lambda: True)
    get_impl_cls = classmethod(lambda cls: cls)


@pytest.fixture
def glm5_flash_attn(tmp_path, monkeypatch, dist_init):
    """Factory: the attention of a GLM-5.3-Flash decoder layer as vLLM builds it."""
    monkeypatch.setattr(mla_attention, "get_attn_backend", lambda *a, **k: _NoGpuMLA)

    def make(layer_idx, checkpoint, quantization, quantization_config, device="meta"):
        config = dict(GLM5_FLASH_CONFIG, quantization_config=checkpoint)
        (tmp_path / "config.json").write_text(json.dumps(config))
        vllm_config = EngineArgs(
            model=str(tmp_path),
            quantization=quantization,
            quantization_config=quantization_config,
            enable_prefix_caching=False,  # as the CPU platform sets it for MLA
        ).create_engine_config()
        hf_config = vllm_config.model_config.hf_text_config
        prefix = f"model.layers.{layer_idx}"
        with (
            set_current_vllm_config(vllm_config),
            set_default_torch_dtype(torch.bfloat16),
            torch.device(device),
        ):
            layer = Glm5NextDecoderLayer(vllm_config, hf_config, layer_idx, prefix)
        return layer.self_attn

    return make
