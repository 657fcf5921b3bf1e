# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How many tokens of GLM-5.3-Flash's KV cache fit in a per-GPU budget.

Builds the target model (45 layers) and its MTP draft (layer 45) on the meta
device, as an H200 (SM90) rank of a tensor-parallel group would, collects every
layer's own `get_kv_cache_spec()` (the 11 MLA layers, the indexer and KPool
tail caches, the KDA recurrent and conv state, the MTP layer) and feeds them to
vLLM's planner (`get_global_kv_cache_groups` / `get_kv_cache_configs`) with
the budget as the memory available for the KV cache. BF16 (`auto`) and FP8
(`fp8`) are planned side by side.

The cache dtype comes from vLLM itself: the engine config is created on vLLM's
CUDA platform reporting capability 9.0 (GLM-5.3-Flash's
`verify_and_update_config` hook runs there), each MLA layer picks its backend
by the CUDA platform's priorities and canonicalizes the dtype as it does on a
GPU, and the CUDA platform sizes the blocks of the hybrid model. Only what
needs a GPU is stubbed: the attention implementations, GEMM kernel selection,
and the CUDA driver (a stub `libcuda.so.1`); the helpers are the
verification suite's (tests/models/glm5next/glm5next_verify.py).

Run inside the managed environment, with the tree to inspect first on
sys.path and tests/models/glm5next on it (`scripts/patchset capacity [--base]
...` does both):

    python -m patchset_tool.reports capacity [--kv-cache-dtype
    auto|fp8|fp8_e4m3|both]
        [--budget-gib X] [--tp N] [--max-model-len L] [--json]
    python -m patchset_tool.reports capacity --batch FILE  (see cli.py)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

from ..runner import TREE_VAR
from .coverage import (
    build_models,
    is_mtp_layer,
    load_helpers,
    positive,
    single_process_distributed,
)

SM90 = (9, 0)
GIB = 1 << 30
DEFAULT_BUDGET_GIB = 65.37
"""The other engine's per-GPU block-cache budget (8xH200, TP8, 0.7)."""
DTYPES = {
    "auto": ("auto",),
    "fp8": ("fp8",),
    "fp8_e4m3": ("fp8_e4m3",),
    "both": ("auto", "fp8"),
}


def load_cuda_driver(helpers: ModuleType, tmp_dir: Path) -> None:
    """Load libcuda.so.1, or build and load the three-symbol stub, so that
    vllm.platforms.cuda imports without a GPU."""
    if not helpers.has_libcuda():
        stub = helpers.build_libcuda_stub(tmp_dir)
        if stub is None:
            sys.exit("capacity needs libcuda.so.1 or gcc to build a driver stub")
        os.environ[helpers.LIBCUDA_STUB_VAR] = str(stub)
    helpers.load_libcuda()


@contextlib.contextmanager
def sm90_platform(helpers: ModuleType) -> Iterator[None]:
    """Make vLLM's CUDA platform, reporting SM90, current; restore after."""
    import vllm.platforms as platforms

    old = platforms.current_platform
    helpers.use_mocked_cuda_platform(*SM90)
    new = platforms.current_platform
    try:
        yield
    finally:
        platforms.current_platform = old
        for name, module in list(sys.modules.items()):
            if (
                name.startswith("vllm")
                and getattr(module, "current_platform", 0) is new
            ):
                module.__dict__["current_platform"] = old


def create_vllm_config(
    model_dir: Path, kv_cache_dtype: str, args: argparse.Namespace
) -> Any:
    """The engine config an SM90 server gets; GLM-5.3-Flash's
    verify_and_update_config hook decides the cache dtype here."""
    from vllm.config import CompilationConfig, PassConfig
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        kv_cache_dtype=kv_cache_dtype,
        tensor_parallel_size=args.tp,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        enforce_eager=True,
        enable_prefix_caching=False,
        distributed_executor_backend="uni",
        # Sizing the all-reduce fusion imports FlashInfer (seconds), and
        # nothing here compiles.
        compilation_config=CompilationConfig(
            pass_config=PassConfig(fuse_allreduce_rms=False)
        ),
    ).create_engine_config()


def gpu_less_impl(real_impl: type, helpers: ModuleType) -> type:
    """The model tests' GPU-less sparse MLA implementation, keeping its
    constructor arguments and, where the real implementation sizes
    fp8_ds_mla rows itself (0.34.0 and later), that method."""

    def keep_arguments(self: Any, **kwargs: Any) -> None:
        from vllm.config import get_current_vllm_config

        self.__dict__.update(kwargs)
        # Built at TP 1: the rank's heads are num_heads / TP.
        tp = get_current_vllm_config().parallel_config.tensor_parallel_size
        rank = kwargs | {"num_heads": kwargs["num_heads"] // tp}
        self.workspace_bytes = workspace_bytes(real_impl, rank)

    attrs: dict[str, Any] = {"__init__": keep_arguments}
    row_bytes = getattr(real_impl, "get_fp8_ds_mla_row_bytes", None)
    if row_bytes is not None:
        attrs["get_fp8_ds_mla_row_bytes"] = row_bytes
    return type(real_impl.__name__, (helpers.NoGpuSparseMLAImpl,), attrs)


def workspace_bytes(real_impl: type, kwargs: dict[str, Any]) -> int:
    """Bytes `real_impl` reserves in vLLM's shared workspace when a layer
    builds it (FlashMLA sparse on a quantized cache: its q and prefill
    buffers, sized by max_num_batched_tokens and max_model_len), read by
    running its constructor with the workspace manager recording."""
    from unittest import mock

    from vllm.utils.math_utils import round_up
    from vllm.v1.worker import workspace

    module = sys.modules[real_impl.__module__]
    if not hasattr(module, "current_workspace_manager"):
        return 0
    asked: list[tuple[tuple[int, ...], Any]] = []

    class Recorder:
        def get_simultaneous(self, *specs: tuple[tuple[int, ...], Any]) -> list:
            asked.extend(specs)
            return []

    with (
        mock.patch.object(module, "current_workspace_manager", Recorder),
        mock.patch.object(module, "num_compute_units", lambda *_: 1, create=True),
        mock.patch("torch.accelerator.current_device_index", lambda: 0),
    ):
        real_impl(**kwargs)
    align = getattr(workspace, "_VIEW_ALIGNMENT", 1)  # 0.33.0 does not align
    return sum(
        round_up(workspace._compute_bytes(shape, dtype), align)
        for shape, dtype in asked
    )


def mla_backend_stub(helpers: ModuleType) -> Any:
    """A `get_attn_backend` for MLAAttention: the backend vLLM's own selector
    picks on the SM90 platform, with an implementation that needs no GPU."""
    from vllm.v1.attention import selector

    def get_attn_backend(head_size: int, *args: Any, **kwargs: Any) -> Any:
        selector._cached_get_attn_backend.cache_clear()
        with sm90_platform(helpers):
            real = selector.get_attn_backend(head_size, *args, **kwargs)
        impl = gpu_less_impl(real.get_impl_cls(), helpers)
        return type(
            real.__name__, (real,), {"get_impl_cls": staticmethod(lambda: impl)}
        )

    return get_attn_backend


def build_layers(vllm_config: Any, tp: int) -> dict[str, Any]:
    """Build target and MTP draft on the meta device; their cache layers.

    The one-rank process group builds the layers at TP 1; the KDA layers,
    whose state is the only TP-sharded cache, are told the TP size of the
    rank they stand for before their specs are read."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    build_models(vllm_config)
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
    num_hidden_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
    for name, layer in layers.items():
        # As SpecDecodeBaseProposer.load_model marks the draft's layers.
        layer.is_draft_layer = is_mtp_layer(name, num_hidden_layers)
        if isinstance(layer, MambaBase):
            layer.tp_size = tp  # type: ignore[attr-defined]
    return layers


def collect_specs(vllm_config: Any, layers: dict[str, Any]) -> dict[str, Any]:
    """Each layer's KV cache spec, as GPUModelRunner.get_kv_cache_spec
    collects it."""
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    specs = {}
    for name, layer in layers.items():
        spec = layer.get_kv_cache_spec(vllm_config)
        if not spec:
            continue
        if isinstance(spec, AttentionSpec):
            spec = customize_attention_spec(layer.get_attn_backend(), spec)
        if layer.is_draft_layer:
            spec = replace(spec, is_draft=True)
        specs[name] = spec
    return specs


def plan(vllm_config: Any, specs: dict[str, Any], budget: int) -> Any:
    """The KV cache plan vLLM makes for one rank with `budget` bytes free, as
    EngineCore._initialize_kv_caches makes it."""
    from vllm.distributed.kv_transfer.kv_connector.utils import (
        get_current_attn_backends,
    )
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )

    backends = get_current_attn_backends(vllm_config)
    supported = [x.name for x in get_supported_kv_cache_layouts(backends)]
    resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    return get_kv_cache_configs(vllm_config, [specs], [budget], groups)[0]


def layer_kind(name: str, spec: Any, num_hidden_layers: int) -> str:
    """Which of GLM-5.3-Flash's caches a layer's spec belongs to."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if isinstance(spec, MambaSpec):
        return "KDA recurrent + conv state"
    if name.endswith("indexer.k_cache"):
        return "indexer K (KPool-compressed)"
    if name.endswith("indexer.tail_cache"):
        return "KPool tail ring"
    if is_mtp_layer(name, num_hidden_layers):
        return "MLA rows (MTP layer 45)"
    return "MLA rows (target)"


def spec_rows(
    specs: dict[str, Any], layers: dict[str, Any], num_hidden_layers: int
) -> list[dict[str, Any]]:
    """One row per kind of cache: layers, dtype and bytes per block/token."""
    rows: dict[str, dict[str, Any]] = {}
    for name, spec in specs.items():
        kind = layer_kind(name, spec, num_hidden_layers)
        row = rows.setdefault(kind, {"kind": kind, "layers": 0})
        row["layers"] += 1
        real = getattr(spec, "real_page_size_bytes", spec.page_size_bytes)
        per_token = kind.startswith(("MLA", "indexer"))
        backend = layers[name].get_attn_backend().get_name()
        row |= {
            "spec": type(spec).__name__,
            "backend": backend,
            "cache_dtype": getattr(spec, "cache_dtype_str", None)
            or str(
                getattr(spec, "dtype", spec.dtypes if hasattr(spec, "dtypes") else "")
            ).replace("torch.", ""),
            "block_size": spec.block_size,
            "page_bytes": spec.page_size_bytes,
            "real_page_bytes": real,
            "bytes_per_token": real / spec.block_size if per_token else None,
        }
    return sorted(rows.values(), key=lambda r: r["kind"])


def group_rows(config: Any) -> list[dict[str, Any]]:
    """The KV cache groups vLLM forms: layers, block size and bytes per block."""
    rows = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        rows.append(
            {
                "layers": len(group.layer_names),
                "first_layer": group.layer_names[0],
                "spec": type(spec).__name__,
                "block_size": spec.block_size,
                "bytes_per_block": spec.page_size_bytes,
            }
        )
    return rows


def capacity(vllm_config: Any, config: Any) -> dict[str, Any]:
    """Blocks, tokens and concurrency of a plan, as vLLM logs them."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    block_size = vllm_config.cache_config.block_size
    # Every KVCacheTensor is a view of the one device backing allocation.
    (pool_bytes,) = {t.size for t in config.kv_cache_tensors if not t.host_resident}
    tokens, concurrency = get_kv_cache_capacity(vllm_config, config)
    return {
        "block_size": block_size,
        "num_blocks": config.num_blocks,
        "pool_bytes": pool_bytes,
        "bytes_per_block": pool_bytes // config.num_blocks,
        # The null block is never handed out.
        "block_tokens": (config.num_blocks - 1) * block_size,
        "vllm_tokens": tokens,
        "max_concurrency": round(concurrency, 3),
    }


def measure_dtype(
    helpers: ModuleType,
    model_dir: Path,
    dtype: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Plan GLM-5.3-Flash's KV cache for `--kv-cache-dtype dtype` on SM90."""
    import pytest

    import vllm.model_executor.layers.attention.mla_attention as mla_attention
    import vllm.v1.worker.utils  # noqa: F401 - import on CPU, not on mocked CUDA

    with pytest.MonkeyPatch.context() as mp:
        helpers.stub_gpu_only_parts(mp)
        mp.setattr(mla_attention, "get_attn_backend", mla_backend_stub(helpers))
        with sm90_platform(helpers):
            vllm_config = create_vllm_config(model_dir, dtype, args)
        engine_dtype = vllm_config.cache_config.cache_dtype
        with single_process_distributed(vllm_config):
            layers = build_layers(vllm_config, args.tp)
            with sm90_platform(helpers):
                from vllm.platforms import current_platform

                current_platform.update_block_size_for_backend(vllm_config)
                specs = collect_specs(vllm_config, layers)
                budget = int(args.budget_gib * GIB)
                config = plan(vllm_config, specs, budget)
                workspace = max(
                    getattr(getattr(layer, "impl", None), "workspace_bytes", 0)
                    for layer in layers.values()
                )
                less = plan(vllm_config, specs, budget - workspace)
    layers_n = vllm_config.model_config.hf_text_config.num_hidden_layers
    return {
        "kv_cache_dtype": dtype,
        "engine_cache_dtype": engine_dtype,
        "workspace_bytes": workspace,
        "vllm_tokens_less_workspace": capacity(vllm_config, less)["vllm_tokens"],
        "caches": spec_rows(specs, layers, layers_n),
        "groups": group_rows(config),
        **capacity(vllm_config, config),
    }


def mla_bytes_per_token(column: dict[str, Any]) -> float:
    """Bytes per token of one target MLA layer's rows."""
    (row,) = (r for r in column["caches"] if r["kind"] == "MLA rows (target)")
    return float(row["bytes_per_token"])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Plan every requested dtype and compare them."""
    helpers = load_helpers()
    with tempfile.TemporaryDirectory() as tmp:
        load_cuda_driver(helpers, Path(tmp))
        model_dir = helpers.write_model_dir(Path(tmp) / "glm-5.3-flash")
        columns = {
            d: measure_dtype(helpers, model_dir, d, args)
            for d in DTYPES[args.kv_cache_dtype]
        }
    report: dict[str, Any] = {
        "tree": os.environ.get(TREE_VAR, "unknown"),
        "budget_gib": args.budget_gib,
        "tp": args.tp,
        "max_model_len": args.max_model_len,
        "columns": columns,
    }
    if len(columns) == 2:
        auto, fp8 = columns["auto"], columns["fp8"]
        report["ratio"] = {
            key: round(fp8[key] / auto[key], 4)
            for key in ("vllm_tokens", "block_tokens")
        }
        # The most the MLA rows alone can give (1024 / 656 for fp8_ds_mla).
        report["mla_row_ratio"] = round(
            mla_bytes_per_token(auto) / mla_bytes_per_token(fp8), 4
        )
    return report


def token_breakdown(column: dict[str, Any]) -> dict[str, float]:
    """Pool bytes per token, split into the per-token caches and the rest
    (the state and tail groups' share of a block, and layout padding)."""
    per_token = {
        row["kind"]: row["bytes_per_token"] * row["layers"]
        for row in column["caches"]
        if row["bytes_per_token"] is not None
    }
    pool = column["bytes_per_block"] / column["block_size"]
    return per_token | {"other": pool - sum(per_token.values()), "pool": pool}


def format_column(column: dict[str, Any]) -> list[str]:
    """The text report of one `--kv-cache-dtype`."""
    lines = [
        (
            f"--kv-cache-dtype {column['kv_cache_dtype']} -> engine cache dtype "
            f"{column['engine_cache_dtype']}, block size {column['block_size']}"
        )
    ]
    for row in column["caches"]:
        per_token = (
            f"{row['bytes_per_token']:7.1f} B/token"
            if row["bytes_per_token"] is not None
            else f"{row['real_page_bytes']:>9,} B/req"
        )
        lines.append(
            f"  {row['kind']:30} x{row['layers']:<3} {row['backend']:27} "
            f"{row['cache_dtype']:20} {per_token}  page {row['page_bytes']:>9,} B"
        )
    for group in column["groups"]:
        lines.append(
            f"  group of {group['layers']:3} layers from {group['first_layer']:44} "
            f"block {group['block_size']:6}  {group['bytes_per_block']:>10,} B/block"
        )
    breakdown = token_breakdown(column)
    lines.append(
        f"  pool: {column['num_blocks']:,} blocks x {column['bytes_per_block']:,} B"
        f" = {column['pool_bytes'] / GIB:.2f} GiB; {breakdown['pool']:.1f} B/token"
        f" of which {breakdown['other']:.1f} B/token state/tail share and padding"
    )
    if column["workspace_bytes"]:
        lines.append(
            f"  sparse MLA workspace reserved at load: "
            f"{column['workspace_bytes'] / GIB:.2f} GiB; with it taken from the "
            f"budget, vLLM's 'KV cache size': "
            f"{column['vllm_tokens_less_workspace']:,} tokens"
        )
    lines.append(
        f"  tokens in the block pool: {column['block_tokens']:,}; vLLM's "
        f"'KV cache size': {column['vllm_tokens']:,} tokens "
        f"({column['max_concurrency']}x requests of max-model-len)"
    )
    return lines


def format_report(report: dict[str, Any], seconds: float) -> str:
    """The text report: each column, then the ratios."""
    lines = [
        f"GLM-5.3-Flash KV cache capacity on SM90 (tree: {report['tree']})",
        (
            f"budget {report['budget_gib']} GiB/GPU, TP {report['tp']}, "
            f"max-model-len {report['max_model_len']:,}, MTP 1"
        ),
    ]
    for column in report["columns"].values():
        lines += format_column(column)
    if "ratio" in report:
        ratio = report["ratio"]
        lines.append(
            f"FP8/BF16: block-pool tokens x{ratio['block_tokens']:.4f} "
            f"({ratio['block_tokens'] - 1:+.2%}), vLLM 'KV cache size' "
            f"x{ratio['vllm_tokens']:.4f} ({ratio['vllm_tokens'] - 1:+.2%}); "
            f"MLA rows alone x{report['mla_row_ratio']:.4f}"
        )
    lines.append(f"[{seconds:.1f} s]")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The report's own options."""
    parser.add_argument(
        "--kv-cache-dtype",
        choices=tuple(DTYPES),
        default="both",
        help="the KV-cache dtype to measure (default: %(default)s)",
    )
    parser.add_argument(
        "--budget-gib",
        type=positive(float),
        default=DEFAULT_BUDGET_GIB,
        metavar="X",
        help="memory for the KV cache per GPU (default: %(default)s)",
    )
    parser.add_argument(
        "--tp",
        type=positive(int),
        default=8,
        metavar="N",
        help="tensor-parallel size (default: %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive(int),
        default=32768,
        metavar="L",
        help="the model length (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=positive(int),
        default=8192,
        metavar="T",
        help="sizes the sparse MLA workspace (default: %(default)s, what "
        "`vllm serve` gets on an H100 or H200; `vllm.LLM` gets 16384)",
    )
