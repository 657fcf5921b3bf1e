# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""pytest plugin: run vLLM's tests on this host as if it were upstream's H200
runner (`pytest -p glm5next_sm90_host ...`, loaded before any conftest).

For the whole session vLLM's current platform answers every device query
as one SM90 CUDA GPU would (`is_cuda`, the compute capability and its
family), DeepGEMM (installed on that runner) reports itself present, and the
CUDA driver is this host's or a stub built with gcc, so `vllm.platforms.cuda`
imports. Only those answers are stubbed: the runtime
stays this host's (CPU tensors, gloo process groups), so a test that needs
a real GPU is skipped as upstream's gates skip it on a GPU-less machine: the
node ids in the file `GLM5NEXT_SM90_GPU_ONLY` names (one per line, `#`
comments), as `pytest` prints them from `tests/`.

What this catches: code that runs on a GPU host before any test body, such
as the model config hooks `create_engine_config` calls, and tests that
assume the host they run on.
"""

import os
import tempfile
from pathlib import Path

import glm5next_verify as verify
import pytest

GPU_ONLY_VAR = "GLM5NEXT_SM90_GPU_ONLY"
CAPABILITY = (9, 0)


def _load_driver() -> None:
    if not verify.has_libcuda() and verify.LIBCUDA_STUB_VAR not in os.environ:
        stub = verify.build_libcuda_stub(Path(tempfile.mkdtemp(prefix="libcuda-")))
        if stub is None:
            raise pytest.UsageError("glm5next_sm90_host needs gcc or libcuda.so.1")
        os.environ[verify.LIBCUDA_STUB_VAR] = str(stub)
    verify.load_libcuda()


def _answer_as_sm90() -> None:
    import vllm.utils.deep_gemm
    from vllm.platforms import current_platform
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    CudaPlatform.import_kernels()  # the CUDA ops a GPU host has registered
    # Upstream's H200 runner has DeepGEMM; only its presence is answered here.
    vllm.utils.deep_gemm.has_deep_gemm = lambda: True

    capability = DeviceCapability(*CAPABILITY)
    answers = {
        "is_cuda": lambda: True,
        "is_cuda_alike": lambda: True,
        "get_device_capability": lambda device_id=0: capability,
        "has_device_capability": lambda c, device_id=0: (
            capability.to_int() >= (c if isinstance(c, int) else c[0] * 10 + c[1])
        ),
        "is_device_capability_family": lambda family, device_id=0: (
            capability.to_int() // 10 == family // 10
        ),
    }
    for name, answer in answers.items():
        setattr(current_platform, name, answer)


def _gpu_only() -> frozenset[str]:
    path = os.environ.get(GPU_ONLY_VAR)
    if not path:
        return frozenset()
    lines = Path(path).read_text().splitlines()
    return frozenset(x.strip() for x in lines if x.strip() and not x.startswith("#"))


_load_driver()
_answer_as_sm90()
_GPU_ONLY = _gpu_only()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a GPU (skipped on a GPU-less host)")
    for item in items:
        if item.nodeid in _GPU_ONLY:
            item.add_marker(skip)
