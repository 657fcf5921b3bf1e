# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared fixtures for GLM-5.3-Flash tests: a real `VllmConfig` of the
published model, and stubs for what only a GPU provides."""

import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# GLM-5.3-Flash's config.json: transformers' Glm5NextTextConfig defaults are
# the published model's, except for these keys.
GLM5_FLASH_CONFIG: dict[str, Any] = {
    "architectures": ["Glm5NextForCausalLM"],
    "model_type": "glm5_next",
    "dtype": "bfloat16",
    "mla_use_nope": True,
    "indexer_rope_interleave": True,
    "index_kpool": 4,
    "index_kpool_compress": True,
    "first_k_dense_replace": 3,
    "mhc": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_router_dtype": "float32",
    "num_nextn_predict_layers": 1,
}


class _NoGpuSparseMLAImpl:
    is_sparse = True
    supports_dense_mha_prefill = False
    dcp_world_size = pcp_world_size = 1

    def __init__(self, **kwargs) -> None:
        pass


class _NoGpuSparseMLABackend:
    get_name = staticmethod(lambda: "NO_GPU_SPARSE_MLA")
    is_mla = staticmethod(lambda: True)
    get_impl_cls = staticmethod(lambda: _NoGpuSparseMLAImpl)


@pytest.fixture
def gpu_stubs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stub what only a GPU provides when layers are built: the sparse MLA
    attention backend."""
    import vllm.model_executor.layers.attention.mla_attention as mla_attention

    monkeypatch.setattr(
        mla_attention, "get_attn_backend", lambda *a, **k: _NoGpuSparseMLABackend
    )


@pytest.fixture
def make_vllm_config(tmp_path: Path) -> Callable[..., Any]:
    """Factory: the `VllmConfig` of serving GLM-5.3-Flash with the given engine
    arguments; `checkpoint_quantization` is the checkpoint's own
    `quantization_config` (None: BF16)."""
    from vllm.engine.arg_utils import EngineArgs

    def make(checkpoint_quantization: dict[str, Any] | None = None, **kwargs):
        config = dict(GLM5_FLASH_CONFIG)
        if checkpoint_quantization is not None:
            config["quantization_config"] = checkpoint_quantization
        model_dir = Path(tempfile.mkdtemp(dir=tmp_path))
        (model_dir / "config.json").write_text(json.dumps(config))
        engine_args = EngineArgs(
            model=str(model_dir),
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            # The CPU platform turns prefix caching off for MLA models.
            enable_prefix_caching=False,
            **kwargs,
        )
        return engine_args.create_engine_config()

    return make


@pytest.fixture
def distributed(
    request: pytest.FixtureRequest, make_vllm_config: Callable[..., Any]
) -> Iterator[None]:
    """Upstream's one-rank `dist_init` process group, set up under
    GLM-5.3-Flash's config."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(make_vllm_config()):
        request.getfixturevalue("dist_init")
    yield
