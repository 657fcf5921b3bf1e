# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared fixtures for GLM-5.3-Flash tests: the published configuration, a
real `VllmConfig` built from it, and the few stubs needed to build the model
without a GPU."""

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

GLM5_FLASH_CONFIG = Path(__file__).with_name("glm-5.3-flash-config.json")
"""GLM-5.3-Flash's published text configuration (45 layers + 1 MTP layer)."""

CHECKPOINTS: dict[str, dict[str, Any] | None] = {
    "bf16": None,
    # Z.ai's FP8 checkpoint: block-FP8 linears and experts, BF16 attention.
    "block-fp8": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    },
}
"""`quantization_config` in config.json of the emulated checkpoints."""

# Modules that pick a GEMM kernel for the current GPU when a linear layer is
# created; there is none on the CPU platform.
_KERNEL_SELECTING_MODULES = (
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.online.fp8",
    "vllm.model_executor.layers.quantization.online.mxfp8",
)


def load_glm5_flash_config() -> dict[str, Any]:
    return json.loads(GLM5_FLASH_CONFIG.read_text())


def write_model_dir(
    path: Path, quantization_config: dict[str, Any] | None = None
) -> Path:
    """Write GLM-5.3-Flash's config.json, optionally with a checkpoint's
    `quantization_config`, to `path`."""
    config = load_glm5_flash_config()
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@contextmanager
def _cpu_platform_without_triton() -> Iterator[None]:
    """Let the CPU platform configure an x86 host without triton-cpu, which only
    its model runner needs: these tests build layers and run no model."""
    import vllm.triton_utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    with mock.patch.object(vllm.triton_utils, "HAS_TRITON", True):
        yield


def create_vllm_config(
    model_dir: Path,
    quantization: str | None = None,
    quantization_config: dict[str, Any] | None = None,
    **kwargs: Any,
):
    from vllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        quantization=quantization,
        quantization_config=quantization_config,
        enforce_eager=True,
        # The CPU platform turns prefix caching off for MLA models.
        enable_prefix_caching=False,
        **kwargs,
    )
    with _cpu_platform_without_triton():
        return engine_args.create_engine_config()


class NoGpuLinearKernel:
    """Stands in for a GPU GEMM kernel: weights are left as the quant method
    made them, and the layer cannot run."""

    def input_quant_key(self) -> None:
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass

    def apply_weights(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError("GEMM kernels need a GPU")


class NoGpuSparseMLAImpl:
    is_sparse = True
    supports_dense_mha_prefill = False
    dcp_world_size = 1
    pcp_world_size = 1

    def __init__(self, **kwargs) -> None:
        pass


class _NoGpuSparseMLABackend:
    @staticmethod
    def get_name() -> str:
        return "NO_GPU_SPARSE_MLA"

    @staticmethod
    def is_mla() -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type[NoGpuSparseMLAImpl]:
        return NoGpuSparseMLAImpl


def stub_gpu_only_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stub what only a GPU provides: the sparse MLA attention backend (built
    after every projection) and GEMM kernel selection for quantized linears."""
    import importlib

    import vllm.model_executor.layers.attention.mla_attention as mla_attention

    monkeypatch.setattr(
        mla_attention, "get_attn_backend", lambda *a, **k: _NoGpuSparseMLABackend
    )
    for module_name in _KERNEL_SELECTING_MODULES:
        module = importlib.import_module(module_name)
        for name in dir(module):
            if name.startswith("init_") and name.endswith("_linear_kernel"):
                monkeypatch.setattr(module, name, lambda *a, **k: NoGpuLinearKernel())


@pytest.fixture
def gpu_stubs(monkeypatch: pytest.MonkeyPatch) -> None:
    stub_gpu_only_parts(monkeypatch)


@pytest.fixture(scope="session")
def glm5_flash_config() -> dict[str, Any]:
    return load_glm5_flash_config()


@pytest.fixture
def glm5_flash_model_dir(tmp_path: Path) -> Path:
    """A model directory holding GLM-5.3-Flash's BF16 config.json."""
    return write_model_dir(tmp_path / "glm-5.3-flash")


@pytest.fixture
def make_glm5_flash_vllm_config(tmp_path: Path) -> Callable[..., Any]:
    """Factory: the `VllmConfig` of serving a `CHECKPOINTS` entry with the given
    `--quantization`, `--quantization-config` and other engine arguments."""

    def make(
        checkpoint: str,
        quantization: str | None = None,
        quantization_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        model_dir = write_model_dir(tmp_path / checkpoint, CHECKPOINTS[checkpoint])
        return create_vllm_config(
            model_dir, quantization, quantization_config, **kwargs
        )

    return make


@pytest.fixture
def distributed(
    request: pytest.FixtureRequest, glm5_flash_model_dir: Path
) -> Iterator[None]:
    """Upstream's one-rank `dist_init` process group (TP = PP = 1) for one test,
    set up under GLM-5.3-Flash's config."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(create_vllm_config(glm5_flash_model_dir)):
        request.getfixturevalue("dist_init")
    yield
