# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Which layers of GLM-5.3-Flash online quantization reaches.

Builds the whole model (45 layers) and its MTP draft (layer 45) on the meta
device, on vLLM's CPU platform, without weights or a GPU, and prints what the
startup log would say: the layers quantized, by projection and by source (the
online config vs the checkpoint's own method), and their total.

Run inside the managed environment, with the tree to inspect first on
sys.path and tests/models/glm5next on it (`scripts/patchset coverage [--base]
...` does both):

    python -m patchset_tool.reports coverage [--config glm-5.3-flash|PATH]
        [--checkpoint bf16|block-fp8|nvfp4] [--quantization Q]
        [--quantization-config JSON] [--json]
    python -m patchset_tool.reports coverage --batch FILE  (see cli.py)

The configuration, the checkpoint emulations and the stubs of GPU-only parts
are the ones of tests/models/glm5next/glm5next_verify.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ..runner import TREE_VAR

NVFP4_CHECKPOINT = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "group_size": 16,
    "kv_cache_quant_algo": None,
    # NVIDIA's NVFP4 export: attention, shared experts and the MTP layer BF16.
    "ignore": [
        "lm_head",
        "model.layers.*.self_attn*",
        "model.layers.*.mlp.gate",
        "model.layers.*.mlp.shared_experts*",
        "model.layers.45*",
    ],
}


def load_helpers() -> ModuleType:
    """The verification suite's public helpers, one copy for every base
    (tests/models/glm5next/glm5next_verify.py): GLM-5.3-Flash's
    configuration, the CPU stubs and the mocked CUDA device. Its folder is
    on sys.path where `runner.run(..., suite=True)` runs the reports."""
    import glm5next_verify

    return glm5next_verify


def checkpoints(helpers: ModuleType) -> dict[str, dict[str, Any] | None]:
    return {**helpers.CHECKPOINTS, "nvfp4": NVFP4_CHECKPOINT}


def write_model_dir(
    helpers: ModuleType, config: str, quant: dict[str, Any] | None, path: Path
) -> Path:
    if config == "glm-5.3-flash":
        return helpers.write_model_dir(path, quant)
    data = json.loads(Path(config).read_text(encoding="utf-8"))
    if quant is not None:
        data["quantization_config"] = quant
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data), encoding="utf-8")
    return path


def stub_nvfp4_kernels(mp: Any, helpers: ModuleType) -> None:
    """Stub the GPU kernel choice of NVIDIA's NVFP4 checkpoint method, which
    the model tests do not use: its linear kernel (as the tests stub the
    others) and its MoE backend (the emulation path, which builds on CPU)."""
    import vllm.model_executor.layers.quantization.modelopt as modelopt
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

    mp.setattr(
        modelopt,
        "init_nvfp4_linear_kernel",
        lambda *a, **k: helpers.NoGpuLinearKernel(),
    )
    mp.setattr(
        modelopt,
        "select_nvfp4_moe_backend",
        lambda **kwargs: (NvFp4MoeBackend.EMULATION, None),
    )


def create_vllm_config(
    helpers: ModuleType, model_dir: Path, args: argparse.Namespace
) -> Any:
    """The engine config of serving `model_dir` with MTP, made by the model
    tests' own factory (which knows the CPU platform's quirks per base)."""
    return helpers.create_vllm_config(
        model_dir,
        args.quantization,
        args.quantization_config,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )


@contextlib.contextmanager
def single_process_distributed(vllm_config: Any) -> Iterator[None]:
    """A one-rank gloo process group (TP = PP = 1) for building the model."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    handle, store = tempfile.mkstemp(prefix="patchset-dist-")
    os.close(handle)
    try:
        with set_current_vllm_config(vllm_config):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                backend="gloo",
                distributed_init_method=f"file://{store}",
            )
            initialize_model_parallel(1, 1)
        yield
    finally:
        cleanup_dist_env_and_memory()
        Path(store).unlink(missing_ok=True)


def online_config(vllm_config: Any) -> Any:
    """The OnlineQuantizationConfig whose layers the startup log counts."""
    from vllm.model_executor.model_loader.base_loader import (
        _get_online_quantization_config,
    )

    return _get_online_quantization_config(vllm_config)


def build_models(vllm_config: Any) -> tuple[Any, Any]:
    """The target model and its MTP draft, built as the model runner does:
    the draft from the target's VllmConfig, so with its quant config."""
    import torch

    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    spec = vllm_config.speculative_config
    with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
        target = initialize_model(vllm_config=vllm_config)
        draft = initialize_model(
            vllm_config=spec.apply_draft_overrides(vllm_config),
            model_config=spec.draft_model_config,
        )
    return target, draft


def checkpoint_layers(model: Any, online_prefixes: set[str]) -> list[str]:
    """Layers the checkpoint's own method quantizes (no online override)."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import (
        QuantizeMethodBase,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )

    unquantized = (
        UnquantizedLinearMethod,
        UnquantizedFusedMoEMethod,
        UnquantizedEmbeddingMethod,
    )
    found = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        prefix = getattr(module, "prefix", None) or getattr(module, "layer_name", name)
        if (
            isinstance(method, QuantizeMethodBase)
            and not isinstance(method, unquantized)
            and prefix not in online_prefixes
        ):
            found.append(prefix)
    return found


def by_projection(prefixes: list[str]) -> Counter[str]:
    from vllm.model_executor.layers.quantization.utils.config_utils import (
        get_layer_name_after_index,
    )

    return Counter(get_layer_name_after_index(p) for p in prefixes)


def is_mtp_layer(prefix: str, num_hidden_layers: int) -> bool:
    return f".layers.{num_hidden_layers}." in f".{prefix}."


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model with the GPU-only parts stubbed and count layers."""
    import pytest

    helpers = load_helpers()
    quant = checkpoints(helpers)[args.checkpoint]
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        helpers.stub_gpu_only_parts(mp)
        stub_nvfp4_kernels(mp, helpers)
        model_dir = write_model_dir(helpers, args.config, quant, Path(tmp) / "model")
        vllm_config = create_vllm_config(helpers, model_dir, args)
        with single_process_distributed(vllm_config):
            target, draft = build_models(vllm_config)
    layers = vllm_config.model_config.hf_text_config.num_hidden_layers
    online = online_config(vllm_config)
    online_layers = list(online.quantized_layers) if online is not None else []
    rows: dict[str, dict[str, list[str]]] = {"target": {}, "mtp": {}}
    for part, model in (("target", target), ("mtp", draft)):
        ckpt = checkpoint_layers(model, set(online_layers))
        for source, prefixes in (("online", online_layers), ("checkpoint", ckpt)):
            rows[part][source] = [
                p for p in prefixes if is_mtp_layer(p, layers) == (part == "mtp")
            ]
    return {
        "tree": os.environ.get(TREE_VAR, "unknown"),
        "config": args.config,
        "checkpoint": args.checkpoint,
        "quantization": vllm_config.model_config.quantization,
        "quantization_config": args.quantization_config,
        "online_quantized": len(rows["target"]["online"]),
        "mtp_online_quantized": len(rows["mtp"]["online"]),
        "by_projection": {
            part: {src: dict(sorted(by_projection(p).items())) for src, p in r.items()}
            for part, r in rows.items()
        },
    }


def format_report(report: dict[str, Any], seconds: float) -> str:
    lines = [
        f"GLM-5.3-Flash online-quantization coverage (tree: {report['tree']})",
        (
            f"config {report['config']}, checkpoint {report['checkpoint']}, "
            f"--quantization {report['quantization']}, "
            f"--quantization-config {json.dumps(report['quantization_config'])}"
        ),
    ]
    for part, title in (("target", "layers 0-44"), ("mtp", "MTP draft (layer 45)")):
        lines.append(f"{title}:")
        for source, counts in report["by_projection"][part].items():
            for projection, count in counts.items():
                lines.append(f"  {projection:40} {count:4}  ({source})")
    lines.append(
        f"Quantizing {report['online_quantized']} layers online "
        f"(startup log; MTP draft adds {report['mtp_online_quantized']}) "
        f"[{seconds:.1f} s]"
    )
    return "\n".join(lines)


def positive(convert: type[int] | type[float]) -> Any:
    """An argparse type: a number of `convert`'s kind above zero."""

    def parse(text: str) -> int | float:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text[:40]} is not above 0")
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text[:40]} is not finite")
        if convert is int and value >= 2**31:
            raise argparse.ArgumentTypeError(f"{text[:40]} is not below 2**31")
        return value

    parse.__name__ = convert.__name__
    return parse


def model_config(text: str) -> str:
    """An argparse type for `--config`: the built-in name, or a readable
    JSON file holding an object."""
    if text == "glm-5.3-flash":
        return text
    try:
        data = json.loads(Path(text).read_text(encoding="utf-8"))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text[:200]}: {exc.strerror}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text[:200]}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{text[:200]}: not a JSON object")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The report's own options."""
    parser.add_argument(
        "--config",
        type=model_config,
        default="glm-5.3-flash",
        metavar="NAME|PATH",
        help="the model config (default: %(default)s)",
    )
    parser.add_argument(
        "--checkpoint",
        default="bf16",
        choices=("bf16", "block-fp8", "nvfp4"),
        help="the checkpoint's quantization (default: %(default)s)",
    )
    parser.add_argument("--quantization", default=None, help="as vLLM's --quantization")
    parser.add_argument(
        "--quantization-config",
        type=json.loads,
        default=None,
        help="as vLLM's --quantization-config (JSON)",
    )
