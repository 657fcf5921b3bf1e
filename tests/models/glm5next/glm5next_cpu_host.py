# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""pytest plugin: run vLLM's tests on this CPU-only x86 host as upstream's
GPU runners run them (`pytest -p glm5next_cpu_host ...`, loaded before any
conftest; the emulated SM90 host loads `glm5next_sm90_host` after it).

A GPU runner has triton and vLLM's GEMM kernels; a CPU build of vLLM on an
x86 host without triton-cpu or AMX lacks three things that tests meet while
they create engine configs and build layers, before any GPU work. Only
these are supplied, for the whole session:

- the CPU platform refuses an engine config without triton-cpu (its model
  runner needs it; no test here starts one): while it checks a config, it
  sees triton as present;
- no MXFP8 linear kernel is listed for the CPU platform: vLLM's own
  emulation kernel (ROCm's and XPU's fallback) is, and keeps the MXFP8
  weights, as GPU kernels do;
- the CPU block-FP8 kernels need AMX: after them, a kernel that builds and
  loads block-FP8 linears and refuses to run a GEMM.
"""

import os
from unittest import mock

import pytest
import torch

os.environ.setdefault("VLLM_MXFP8_EMULATION_DEQUANT_AT_LOAD", "0")


def _config_check_without_triton_cpu() -> None:
    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls, vllm_config) -> None:
        with mock.patch.object(vllm.triton_utils, "HAS_TRITON", True):
            check(cls, vllm_config)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign, assignment]


def _linear_kernels_on_cpu() -> None:
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.mxfp8.emulation import (
        EmulationMxfp8LinearKernel,
    )
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (  # noqa: E501
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.platforms import PlatformEnum

    class NoGemmFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs) -> torch.Tensor:
            raise NotImplementedError("no block-FP8 GEMM on this host")

    for kernels, kernel in (
        (linear._POSSIBLE_MXFP8_KERNELS, EmulationMxfp8LinearKernel),
        (linear._POSSIBLE_FP8_BLOCK_KERNELS, NoGemmFp8BlockKernel),
    ):
        kernels.setdefault(PlatformEnum.CPU, []).append(kernel)  # type: ignore[arg-type]


try:
    _config_check_without_triton_cpu()
    _linear_kernels_on_cpu()
except (ImportError, AttributeError) as exc:  # a vLLM this plugin does not know
    raise pytest.UsageError(f"glm5next_cpu_host: {exc}") from exc
