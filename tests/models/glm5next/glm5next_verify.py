# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared helpers of this project's GLM-5.3-Flash verification suite, and of
`scripts/patchset coverage` and `capacity`, which load this file.

One copy for every base. It holds:

* the model: GLM-5.3-Flash's published configuration and the model
  directories and `VllmConfig`s built from it;
* the CPU stubs: what only a GPU provides when a layer or the whole model is
  built on CPU (GEMM kernel selection, the sparse MLA backend);
* the mocked CUDA device: vLLM's own CUDA platform reporting a chosen
  compute capability, a stub `libcuda.so.1` for its extension's three driver
  symbols, and CUDA allocations sent to the meta device (a backend module
  that allocates a workspace when imported can then be imported);
* the two trees: where the pristine and the patched `vllm` package of the
  base under test live (`scripts/patchset test` names them).

Importing this module imports neither torch nor vLLM.
"""

import ctypes
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

GLM5_FLASH_CONFIG = HERE / "glm-5.3-flash-config.json"
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

PRISTINE_ROOT_VAR = "GLM5NEXT_VERIFY_PRISTINE_ROOT"
PATCHED_ROOT_VAR = "GLM5NEXT_VERIFY_PATCHED_ROOT"
"""Directories holding the base's pristine and patched `vllm` package."""
CACHE_VAR_SUFFIX = "_CACHE"
"""`<ROOT_VAR>_CACHE`: that tree's VLLM_CACHE_ROOT (optional)."""

LIBCUDA_STUB_VAR = "GLM5NEXT_VERIFY_LIBCUDA_STUB"

_LIBCUDA_STUB_SOURCE = """
int cuGetProcAddress_v2(void) { return 100; }
int cuPointerGetAttribute(void) { return 100; }
int cuTensorMapEncodeTiled(void) { return 100; }
"""

COMPUTE_UNITS = {9: 132, 10: 148}
"""SMs of an H200 / B200, for backends that read the count at import."""
DEVICE_COUNT = 8
"""GPUs of the mocked node, so that parallel configs up to 8 ranks build."""

# Modules that pick a GEMM kernel for the current GPU when a linear layer is
# created; there is none on the CPU platform.
_KERNEL_SELECTING_MODULES = (
    "vllm.model_executor.layers.quantization.fp8",
    "vllm.model_executor.layers.quantization.online.fp8",
    "vllm.model_executor.layers.quantization.online.mxfp8",
)


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------


def load_glm5_flash_config() -> dict[str, Any]:
    return json.loads(GLM5_FLASH_CONFIG.read_text())


def write_model_dir(
    path: Path,
    quantization_config: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Write a config-only model directory to `path`: GLM-5.3-Flash's
    config.json (or `config`), optionally with a checkpoint's
    `quantization_config`."""
    config = dict(load_glm5_flash_config() if config is None else config)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@contextmanager
def cpu_platform_without_triton() -> Iterator[None]:
    """Let the CPU platform configure an x86 host without triton-cpu, which
    only its model runner needs: the callers build layers and run no model."""
    from unittest import mock

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
    """The `VllmConfig` of serving `model_dir` with dummy weights."""
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
    with cpu_platform_without_triton():
        return engine_args.create_engine_config()


# --------------------------------------------------------------------------
# CPU stubs
# --------------------------------------------------------------------------


class NoGpuLinearKernel:
    """Stands in for a GPU GEMM kernel: weights are left as the quant method
    made them, and the layer cannot run."""

    def input_quant_key(self) -> None:
        return None

    def process_weights_after_loading(self, layer: Any) -> None:
        pass

    def apply_weights(self, *args, **kwargs) -> Any:
        raise NotImplementedError("GEMM kernels need a GPU")


class NoGpuSparseMLAImpl:
    is_sparse = True
    supports_dense_mha_prefill = False
    dcp_world_size = 1
    pcp_world_size = 1

    def __init__(self, **kwargs) -> None:
        pass


class NoGpuSparseMLABackend:
    @staticmethod
    def get_name() -> str:
        return "NO_GPU_SPARSE_MLA"

    @staticmethod
    def is_mla() -> bool:
        return True

    @staticmethod
    def get_impl_cls() -> type[NoGpuSparseMLAImpl]:
        return NoGpuSparseMLAImpl


def stub_gpu_only_parts(monkeypatch: Any) -> None:
    """Stub what only a GPU provides (with a `pytest.MonkeyPatch`): the
    sparse MLA attention backend (built after every projection) and GEMM
    kernel selection for quantized linears."""
    import importlib

    import vllm.model_executor.layers.attention.mla_attention as mla_attention

    monkeypatch.setattr(
        mla_attention, "get_attn_backend", lambda *a, **k: NoGpuSparseMLABackend
    )
    for module_name in _KERNEL_SELECTING_MODULES:
        module = importlib.import_module(module_name)
        for name in dir(module):
            if name.startswith("init_") and name.endswith("_linear_kernel"):
                monkeypatch.setattr(module, name, lambda *a, **k: NoGpuLinearKernel())


# --------------------------------------------------------------------------
# The mocked CUDA device
# --------------------------------------------------------------------------


def use_mocked_cuda_platform(major: int, minor: int) -> None:
    """Make vLLM's CUDA platform current, reporting the given capability and
    that generation's SM count, on a node of DEVICE_COUNT GPUs."""
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(major, minor)

    def num_compute_units(cls, device_id: int = 0) -> int:
        return COMPUTE_UNITS[major]

    def device_count(cls) -> int:
        return DEVICE_COUNT

    mocked_cls = type(
        "MockedCudaPlatform",
        (CudaPlatform,),
        {
            "get_device_capability": classmethod(get_device_capability),
            "num_compute_units": classmethod(num_compute_units),
            "device_count": classmethod(device_count),
        },
    )
    old = platforms.current_platform
    new = mocked_cls()
    platforms.current_platform = new
    # Modules imported so far bound the old platform by name.
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "current_platform", 0) is old:
            module.__dict__["current_platform"] = new


@contextmanager
def cuda_allocations_on_meta() -> Iterator[None]:
    """Send every tensor created for the CUDA device to the meta device
    (no memory, no driver): backends that allocate a workspace when their
    module is imported (CUTLASS MLA's 128 MB) then import on a CPU host."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToMeta(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "meta"
            return func(*args, **kwargs)

    with CudaToMeta():
        yield


def build_libcuda_stub(tmp_dir: Path) -> Path | None:
    """A stub `libcuda.so.1` built with gcc in `tmp_dir`; None without gcc."""
    gcc = shutil.which("gcc")
    if gcc is None:
        return None
    source = tmp_dir / "libcuda_stub.c"
    source.write_text(_LIBCUDA_STUB_SOURCE)
    library = tmp_dir / "libcuda.so.1"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", library, source],
        check=True,
    )
    return library


def has_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def load_libcuda() -> None:
    """Load the driver, or the stub `LIBCUDA_STUB_VAR` names, globally, so
    that vLLM's CUDA extension resolves its driver symbols."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_GLOBAL)
    except OSError:
        ctypes.CDLL(os.environ[LIBCUDA_STUB_VAR], mode=os.RTLD_GLOBAL)


def init_single_process_groups() -> None:
    """One-rank process groups, as upstream's `dist_init` makes them."""
    import tempfile

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    store = tempfile.mkstemp()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"file://{store}",
        local_rank=0,
        backend="gloo",
    )
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(1, 1)


# --------------------------------------------------------------------------
# The two trees
# --------------------------------------------------------------------------


def tree_root(var: str) -> Path | None:
    """The directory holding a `vllm` package that `var` names, if set."""
    value = os.environ.get(var)
    return Path(value).resolve() if value else None


def holds_vllm(path: str) -> bool:
    return bool(path) and (Path(path) / "vllm" / "__init__.py").is_file()


def tree_env(root: Path, cache_root: str | None) -> dict[str, str]:
    """This process's environment with `root` as the only directory of
    PYTHONPATH that holds a `vllm` package (a parent's tree is dropped)."""
    env = dict(os.environ)
    kept = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    kept = [p for p in kept if not holds_vllm(p)]
    env["PYTHONPATH"] = os.pathsep.join([str(root), *kept])
    if cache_root:
        env["VLLM_CACHE_ROOT"] = cache_root
    return env
