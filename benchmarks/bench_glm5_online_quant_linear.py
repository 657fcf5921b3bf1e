# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5.3-Flash's online-quantizable projections on SM90: BF16 against
vLLM 0.34.0's online schemes, with the linear kernels an SM90 GPU gets.

The projections are the 196 that patch 0001 lets `--quantization-config`
targets reach (per layer, TP shard sizes from vLLM's layer classes):

* KDA (34 layers): `in_proj_qkvbfg_a`, a merged column-parallel linear whose
  q|k|v|beta shards split over TP and whose f_a|g_a shards are replicated
  (`_Glm5NextMergedColumnParallelLinear`, common/kda.py), and `o_proj`
  (row-parallel);
* MLA (11 layers): `fused_qkv_a_proj` (replicated), `q_b_proj`
  (column-parallel), `o_proj` (row-parallel), the indexer's `wq_b`
  (replicated) (common/attention.py);
* shared experts (42 MoE layers): `gate_up_proj` (merged column-parallel) and
  `down_proj` (row-parallel) (`Glm5NextMLP`, common/model.py).

The "non-KDA 128" set leaves the 68 KDA projections out.

Each row calls what vLLM 0.34.0 runs for a linear layer on an H200:

* `bf16`: `UnquantizedLinearMethod` -> `cuda_unquantized_gemm`, i.e.
  `F.linear` (the cute-DSL skinny GEMM has plans for SM121 only);
* `fp8_per_tensor`: `Fp8PerTensorOnlineLinearMethod` -> `CutlassFP8Scaled
  MMLinearKernel`: one weight scale, activations per token
  (`dynamic_per_token_scaled_fp8_quant`, since CUTLASS FP8 is supported), then
  `cutlass_scaled_mm`; N padded to 16 at load and the output sliced back;
* `fp8_per_channel`: `Fp8PtpcOnlineLinearMethod`, the same kernel and
  activation quantization with a scale per output channel;
* `fp8_per_block`: `Fp8PerBlockOnlineLinearMethod` -> `CutlassFp8BlockScaled
  MMKernel`: 128x128 weight blocks (`per_block_cast_to_fp8`), 1x128
  activation groups (`per_token_group_fp8_quant`, column-major scales), then
  `cutlass_scaled_mm` with block scales. Ahead of it vLLM prefers FlashInfer's
  block-scale GEMM (M < 32) with DeepGEMM (M >= 32), which needs DeepGEMM's
  JIT (nvcc >= 12.9) and N % 64 == 0; those are not timed here;
* `mxfp8_marlin`: `Mxfp8OnlineLinearMethod` on SM90 gets Humming's MXFP8 kernel
  (humming-kernels, JIT, preferred over Marlin at SM90), not timed here; this
  row is the next kernel in vLLM's list, `MarlinMxfp8LinearKernel`: FP8 weights
  with E8M0 scales per 32, BF16 activations (`marlin_gemm`, W8A16).

Weights are quantized with vLLM's own functions, read from its source (see
`load_vllm`). Timing: CUDA events around each call, the calls of all schemes
alternating within each round, the L2 cache flushed before every call; the
median per round, then the median over rounds. Numerics: the relative
Frobenius error of each scheme's output against an fp32 product of the BF16
operands, on random data (Gaussian activations, and the same with 1% of the
channels 20x larger): kernel numerics, not model accuracy.
"""

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SCHEMES = ("bf16", "fp8_per_tensor", "fp8_per_channel", "fp8_per_block", "mxfp8_marlin")
KERNELS = {
    "bf16": "F.linear (cuda_unquantized_gemm)",
    "fp8_per_tensor": "CutlassFP8ScaledMMLinearKernel, per-token activations",
    "fp8_per_channel": "CutlassFP8ScaledMMLinearKernel, per-token activations",
    "fp8_per_block": "CutlassFp8BlockScaledMMKernel, 1x128 activation groups",
    "mxfp8_marlin": "MarlinMxfp8LinearKernel (W8A16); SM90 default is Humming",
}
DECODE_M = (1, 4, 16, 64, 128, 256)
PREFILL_M = (2048, 8192, 32768)
L2_FLUSH_BYTES = 256 << 20
FP8_BLOCK = 128
CUTLASS_ALIGN = 16


@dataclass(frozen=True)
class Projection:
    """One kind of projection: its per-rank weight is [n, k]."""

    name: str
    group: str  # "kda", "mla" or "shared_expert"
    count: int
    n: int
    k: int


def _shard(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise ValueError(f"{what} ({size}) does not split over TP {tp}")
    return size // tp


def projections(config: dict[str, Any], tp: int) -> list[Projection]:
    """The 196 target projections of `config` (GLM-5.3-Flash's text config),
    as one rank of tensor parallelism `tp` holds them."""
    hidden = config["hidden_size"]
    kda = config["linear_attn_config"]
    kda_layers = len(kda["kda_layers"])
    mla_layers = len(kda["full_attn_layers"])
    moe_layers = sum(t == "sparse" for t in config["mlp_layer_types"])
    kda_proj = kda["num_heads"] * kda["head_dim"]
    # q|k|v|beta split over TP, f_a|g_a (head_dim each) replicated.
    kda_in = _shard(3 * kda_proj + kda["num_heads"], tp, "KDA q|k|v|beta")
    kda_in += 2 * kda["head_dim"]
    heads = _shard(config["num_attention_heads"], tp, "MLA heads")
    qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    q_lora = config["q_lora_rank"]
    kv_a = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    shared = config["moe_intermediate_size"] * config["n_shared_experts"]
    shared_rank = _shard(shared, tp, "shared-expert intermediate size")
    return [
        Projection("kda.in_proj_qkvbfg_a", "kda", kda_layers, kda_in, hidden),
        Projection(
            "kda.o_proj",
            "kda",
            kda_layers,
            hidden,
            _shard(kda_proj, tp, "KDA heads x head_dim"),
        ),
        Projection("mla.fused_qkv_a_proj", "mla", mla_layers, q_lora + kv_a, hidden),
        Projection("mla.q_b_proj", "mla", mla_layers, heads * qk_head, q_lora),
        Projection(
            "mla.o_proj", "mla", mla_layers, hidden, heads * config["v_head_dim"]
        ),
        Projection(
            "mla.indexer.wq_b",
            "mla",
            mla_layers,
            config["index_n_heads"] * config["index_head_dim"],
            q_lora,
        ),
        Projection(
            "shared_experts.gate_up_proj",
            "shared_expert",
            moe_layers,
            2 * shared_rank,
            hidden,
        ),
        Projection(
            "shared_experts.down_proj", "shared_expert", moe_layers, hidden, shared_rank
        ),
    ]


def target_sets(projs: list[Projection]) -> dict[str, list[Projection]]:
    """The description's two target sets: all 196, and the 128 without KDA."""
    return {
        "all_196": list(projs),
        "non_kda_128": [p for p in projs if p.group != "kda"],
    }


def distinct_shapes(by_tp: dict[int, list[Projection]]) -> list[tuple[int, int]]:
    """Every (n, k) the projections of all TP sizes need, once, in order."""
    seen: dict[tuple[int, int], None] = {}
    for projs in by_tp.values():
        for p in projs:
            seen.setdefault((p.n, p.k), None)
    return list(seen)


def summed_times(
    projs: list[Projection],
    times: dict[tuple[int, int], dict[str, float | None]],
    schemes: tuple[str, ...],
) -> dict[str, dict[str, float | None]]:
    """Per target set and scheme: the projection time of one step (sum of
    count x time over the set's projections, microseconds), and the whole
    196-projection step with that set quantized and the rest BF16.

    `times[(n, k)][scheme]` is one call's time, None where the scheme cannot
    run that shape; a sum that needs such a cell is None.
    """

    def total(ps: list[Projection], scheme: str) -> float | None:
        cells = [times[(p.n, p.k)][scheme] for p in ps]
        if any(c is None for c in cells):
            return None
        return sum(p.count * c for p, c in zip(ps, cells) if c is not None)

    out: dict[str, dict[str, float | None]] = {}
    for set_name, members in target_sets(projs).items():
        rest = [p for p in projs if p not in members]
        rest_bf16 = total(rest, "bf16")
        row: dict[str, float | None] = {}
        for scheme in schemes:
            quantized = total(members, scheme)
            row[scheme] = quantized
            row[f"step_{scheme}"] = (
                None
                if quantized is None or rest_bf16 is None
                else quantized + rest_bf16
            )
        out[set_name] = row
    return out


def load_config(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


# --------------------------------------------------------------------------
# GPU side
# --------------------------------------------------------------------------


def load_vllm() -> SimpleNamespace:
    """The ops of vLLM 0.34.0 (`_C_stable_libtorch`) and the weight-side
    functions of its online schemes, compiled from its source with the
    GPU-free parts of vLLM they name supplied here."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_glm5_mla_kv_cache import from_vllm_source

    import vllm._C_stable_libtorch  # noqa: F401  (registers torch.ops._C)
    from vllm.scalar_type import scalar_types

    fp8 = torch.float8_e4m3fn
    platform = SimpleNamespace(fp8_dtype=lambda: fp8, is_fp8_fnuz=lambda: False)
    math_utils = from_vllm_source("utils/math_utils.py", ("cdiv", "round_up"))
    quant_utils = from_vllm_source(
        "model_executor/layers/quantization/utils/quant_utils.py",
        ("get_fp8_min_max", "weight_amax"),
        {"torch": torch, "current_platform": platform},
    )
    common = {"torch": torch, "current_platform": platform, **math_utils}
    common.update(quant_utils)
    online = from_vllm_source(
        "model_executor/layers/quantization/online/fp8.py",
        (
            "_fp8_max",
            "_fp8_scale",
            "_fp8_channel_scale",
            "_QUANT_CHUNK_ELEMS",
            "_fp8_quant_per_channel",
        ),
        common,
    )
    deep_gemm = from_vllm_source(
        "utils/deep_gemm.py",
        ("_ceil_to_ue8m0", "_align", "DEFAULT_BLOCK_SIZE", "per_block_cast_to_fp8"),
        common,
    )
    mxfp8 = from_vllm_source(
        "model_executor/layers/quantization/utils/mxfp8_utils.py",
        (
            "MXFP8_VALUE_DTYPE",
            "MXFP8_SCALE_DTYPE",
            "MXFP8_BLOCK_SIZE",
            "_mxfp8_e4m3_quantize_torch",
        ),
        common,
    )
    quiet = SimpleNamespace(warning_once=lambda *a, **k: None)
    marlin = from_vllm_source(
        "model_executor/layers/quantization/utils/marlin_utils.py",
        (
            "GPTQ_MARLIN_TILE",
            "MARLIN_MAX_BLOCKS_PER_SM",
            "USE_FP32_REDUCE_DEFAULT",
            "marlin_padded_nk",
            "marlin_repacked_nk",
            "marlin_pad_qweight",
            "marlin_pad_scales",
            "marlin_pad_dim",
            "marlin_unpad_output",
            "get_scale_perms",
            "marlin_permute_scales",
            "marlin_permute_bias",
        ),
        {**common, "math": math, "logger": quiet},
    )

    def replace_parameter(layer: Any, name: str, value: Any) -> None:
        setattr(layer, name, value)

    def gptq_marlin_repack(b_q_weight, size_k, size_n, num_bits):
        return torch.ops._C.gptq_marlin_repack(b_q_weight, size_k, size_n, num_bits)

    marlin_fp8 = from_vllm_source(
        "model_executor/layers/quantization/utils/marlin_utils_fp8.py",
        (
            "pack_fp8_to_int32",
            "mxfp8_marlin_process_scales",
            "prepare_mxfp8_layer_for_marlin",
        ),
        {
            **common,
            **marlin,
            "replace_parameter": replace_parameter,
            "ops": SimpleNamespace(gptq_marlin_repack=gptq_marlin_repack),
        },
    )
    return SimpleNamespace(
        ops=torch.ops._C,
        fp8_min_max=quant_utils["get_fp8_min_max"](),
        fp8_e4m3_id=scalar_types.float8_e4m3fn.id,
        **quant_utils,
        **online,
        **deep_gemm,
        **mxfp8,
        **marlin,
        **marlin_fp8,
    )


def _pad_cols_to(t: Any, multiple: int, value: float = 0.0) -> Any:
    import torch.nn.functional as F

    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad), value=value) if pad else t


def make_scheme(v: SimpleNamespace, scheme: str, w: Any) -> Callable[[Any], Any] | str:
    """The forward of one projection under `scheme` for the BF16 weight `w`
    ([n, k]): weights prepared as vLLM's online method and kernel do at load,
    the call as the kernel's `apply_weights`. A string says why it cannot run."""
    import torch
    import torch.nn.functional as F

    n, k = w.shape
    ops = v.ops
    fp8_min, fp8_max = v.fp8_min_max
    if scheme == "bf16":
        return lambda x: F.linear(x, w)

    if scheme in ("fp8_per_tensor", "fp8_per_channel"):
        if scheme == "fp8_per_tensor":
            # Fp8PerTensorOnlineLinearMethod.process_weights_after_loading
            w_s = v._fp8_scale(v.weight_amax(w).reshape(1))
            q = torch.empty_like(w, dtype=torch.float8_e4m3fn)
            ops.static_scaled_fp8_quant(q, w, w_s, None)
        else:
            # Fp8PtpcOnlineLinearMethod.process_weights_after_loading
            w_s = v._fp8_channel_scale(v.weight_amax(w, dim=-1, keepdim=True))
            q = v._fp8_quant_per_channel(w, w_s)
        # CutlassFP8ScaledMMLinearKernel.process_weights_after_loading: B is
        # [K, N] column-major, N and K padded to 16 (scales padded with 1.0).
        if k % CUTLASS_ALIGN:
            return "K not a multiple of 16"
        b = _pad_cols_to(q, CUTLASS_ALIGN).t()
        if w_s.numel() > 1:
            w_s = _pad_cols_to(w_s.reshape(-1, 1), CUTLASS_ALIGN, 1.0)
        padded_n = b.shape[1]

        def fp8_mm(x):
            m = x.shape[0]
            x_q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
            x_s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
            ops.dynamic_per_token_scaled_fp8_quant(x_q, x, x_s, None)
            out = torch.empty((m, padded_n), device=x.device, dtype=x.dtype)
            ops.cutlass_scaled_mm(out, x_q, b, x_s, w_s, None)
            return out[:, :n].contiguous() if padded_n != n else out

        return fp8_mm

    if scheme == "fp8_per_block":
        # ops.cutlass_scaled_mm sends a B that is not 16-aligned to
        # triton_scaled_mm, which takes no block scales.
        if n % CUTLASS_ALIGN or k % CUTLASS_ALIGN:
            return (
                "N or K not a multiple of 16: vLLM falls back to "
                "triton_scaled_mm, which rejects block scales"
            )
        q, w_s = v.per_block_cast_to_fp8(w, [FP8_BLOCK, FP8_BLOCK], use_ue8m0=False)
        groups = k // FP8_BLOCK

        def block_mm(x):
            m = x.shape[0]
            x_q = torch.empty_like(x, dtype=torch.float8_e4m3fn)
            x_s = torch.empty((groups, m), device=x.device, dtype=torch.float32).t()
            ops.per_token_group_fp8_quant(
                x, x_q, x_s, FP8_BLOCK, 1e-10, fp8_min, fp8_max, False, True, False
            )
            out = torch.empty((m, n), device=x.device, dtype=x.dtype)
            ops.cutlass_scaled_mm(out, x_q, q.t(), x_s, w_s.t(), None)
            return out

        return block_mm

    if scheme == "mxfp8_marlin":
        q, scales = v._mxfp8_e4m3_quantize_torch(w.contiguous())
        layer = SimpleNamespace(
            weight=q,
            weight_scale=scales,
            output_size_per_partition=n,
            input_size_per_partition=k,
            bias=None,
        )
        default = torch.get_default_dtype()
        torch.set_default_dtype(w.dtype)
        try:
            v.prepare_mxfp8_layer_for_marlin(layer)
        finally:
            torch.set_default_dtype(default)
        padded_n, padded_k = v.marlin_repacked_nk(layer.weight, num_bits=8)
        sms = torch.cuda.get_device_properties(w.device).multi_processor_count
        workspace = torch.zeros(
            sms * v.MARLIN_MAX_BLOCKS_PER_SM, dtype=torch.int, device=w.device
        )

        def marlin_mm(x):
            # apply_mxfp8_marlin_linear; atomic-add reduce is off by default
            a = v.marlin_pad_dim(x, k, padded_k)
            out = ops.marlin_gemm(
                a,
                None,
                layer.weight,
                None,
                layer.weight_scale,
                None,
                None,
                workspace,
                v.fp8_e4m3_id,
                a.shape[0],
                padded_n,
                padded_k,
                False,
                v.USE_FP32_REDUCE_DEFAULT,
                False,
            )
            return v.marlin_unpad_output(out, n, padded_n)

        return marlin_mm
    raise ValueError(f"unknown scheme {scheme}")


def time_calls(
    fns: Sequence[Callable[..., Any]], rounds: int, iters: int, warmup: int, flush
) -> list[float]:
    """Median over rounds of each fn's per-round median (us), timed as the
    KV-cache benchmark times its paths (`time_group`: calls alternate, the
    L2 flushed before each)."""
    from bench_glm5_mla_kv_cache import time_group

    per_round = time_group(list(fns), rounds, iters, warmup, flush)
    return [statistics.median(r[i] for r in per_round) for i in range(len(fns))]


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def measure(
    v: SimpleNamespace, shapes: list[tuple[int, int]], args: argparse.Namespace
) -> dict:
    """Per shape: each scheme's call time per M, and its numerics."""
    import torch

    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, Any] = {}
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(
            torch.bfloat16
        )
        made: dict[str, Callable[[Any], Any] | str] = {}
        for s in args.schemes:
            try:
                made[s] = make_scheme(v, s, w)
            except Exception as exc:  # a weight preparation that fails
                made[s] = _why(exc)
        runnable = [s for s in args.schemes if callable(made[s])]
        cell: dict[str, Any] = {
            "n": n,
            "k": k,
            "unsupported": {s: made[s] for s in args.schemes if not callable(made[s])},
            "times_us": {},
            "rel_err": {},
        }
        # numerics
        x = torch.randn(args.acc_m, k, generator=gen, device="cuda")
        outlier = x.clone()
        idx = torch.randperm(k, generator=gen, device="cuda")[: max(1, k // 100)]
        outlier[:, idx] *= 20.0
        for kind, data in (("gaussian", x), ("outlier_channels", outlier)):
            xb = data.to(torch.bfloat16)
            ref = xb.float() @ w.float().t()
            errs = {}
            for s in runnable:
                fn = made[s]
                assert callable(fn)
                try:
                    y = fn(xb).float()
                    errs[s] = ((y - ref).norm() / ref.norm()).item()
                except Exception as exc:  # a kernel that rejects the shape
                    made[s] = _why(exc)
                    cell["unsupported"][s] = made[s]
            cell["rel_err"][kind] = errs
        runnable = [s for s in runnable if callable(made[s])]
        # timing
        for m in args.m:
            xm = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            fns = [(lambda f=made[s], x=xm: f(x)) for s in runnable]
            iters = args.iters if m <= max(DECODE_M) else args.prefill_iters
            try:
                us = time_calls(fns, args.rounds, iters, args.warmup, flush)
            except Exception as exc:
                cell["unsupported"][f"M={m}"] = _why(exc)
                us = []
            cell["times_us"][str(m)] = dict(zip(runnable, us))
            del xm
        print(
            f"[{n}x{k}] "
            + " ".join(
                f"M={m}:"
                + ",".join(f"{t:.1f}" for t in cell["times_us"][str(m)].values())
                for m in args.m
            ),
            flush=True,
        )
        if cell["unsupported"]:
            print(f"[{n}x{k}] cannot run: {cell['unsupported']}", flush=True)
        results[f"{n}x{k}"] = cell
        del w, made
        torch.cuda.empty_cache()
    return results


def _fmt(t: float | None) -> str:
    return "n/a" if t is None else f"{t:,.1f}"


def _ratio(t: float | None, base: float | None) -> str:
    return "n/a" if t is None or not base else f"{t / base:.2f}"


def report_tables(
    by_tp: dict[int, list[Projection]],
    measured: dict[str, Any],
    schemes: tuple[str, ...],
    ms: tuple[int, ...],
) -> tuple[str, dict]:
    """Markdown tables: per projection the BF16 time and each scheme's ratio;
    per target set the summed step time; and the numerics."""
    lines: list[str] = []
    sums: dict[str, Any] = {}
    quant = [s for s in schemes if s != "bf16"]
    for tp, projs in by_tp.items():
        lines += [
            f"\n### TP{tp}: one call, BF16 us and scheme/BF16 time ratio",
            "",
            "| projection (count) | N x K | M | bf16 us | " + " | ".join(quant) + " |",
            "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in quant) + " |",
        ]
        for p in projs:
            cell = measured[f"{p.n}x{p.k}"]
            for m in ms:
                t = cell["times_us"][str(m)]
                base = t.get("bf16")
                lines.append(
                    f"| {p.name} ({p.count}) | {p.n} x {p.k} | {m} | {_fmt(base)} | "
                    + " | ".join(_ratio(t.get(s), base) for s in quant)
                    + " |"
                )
        lines += [
            f"\n### TP{tp}: projection time per step (us, sum of count x call)",
            "",
            "| M | set | bf16 | "
            + " | ".join(quant)
            + " | step, all 196: bf16 | "
            + " | ".join(f"step {s}" for s in quant)
            + " |",
            "| ---: | --- | ---: | "
            + " | ".join("---:" for _ in quant)
            + " | ---: | "
            + " | ".join("---:" for _ in quant)
            + " |",
        ]
        for m in ms:
            times = {
                (p.n, p.k): {
                    s: measured[f"{p.n}x{p.k}"]["times_us"][str(m)].get(s)
                    for s in schemes
                }
                for p in projs
            }
            summed = summed_times(projs, times, schemes)
            sums[f"tp{tp}_m{m}"] = summed
            for set_name, row in summed.items():
                base = row["bf16"]
                step_base = row["step_bf16"]
                lines.append(
                    f"| {m} | {set_name} | {_fmt(base)} | "
                    + " | ".join(
                        f"{_fmt(row[s])} ({_ratio(row[s], base)})" for s in quant
                    )
                    + f" | {_fmt(step_base)} | "
                    + " | ".join(
                        f"{_fmt(row[f'step_{s}'])} "
                        f"({_ratio(row[f'step_{s}'], step_base)})"
                        for s in quant
                    )
                    + " |"
                )
    lines += [
        "\n### Numerics: relative error of the output against fp32 (random data)",
        "",
        "| N x K | data | " + " | ".join(schemes) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in schemes) + " |",
    ]
    for key, cell in measured.items():
        for kind, errs in cell["rel_err"].items():
            lines.append(
                f"| {key.replace('x', ' x ')} | {kind} | "
                + " | ".join(f"{errs[s]:.2e}" if s in errs else "n/a" for s in schemes)
                + " |"
            )
    return "\n".join(lines), sums


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parent
    parser.add_argument(
        "--config",
        type=Path,
        default=here / "glm-5.3-flash-config.json",
        help="GLM-5.3-Flash's config.json (the series' test copy)",
    )
    parser.add_argument("--tp", type=_ints, default=(1, 8))
    parser.add_argument("--m", type=_ints, default=DECODE_M + PREFILL_M)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=40, help="per round, decode M")
    parser.add_argument("--prefill-iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--acc-m", type=int, default=64, help="rows for numerics")
    parser.add_argument("--shapes-only", action="store_true", help="print the shapes")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    args.schemes = tuple(args.schemes.split(","))
    unknown = set(args.schemes) - set(SCHEMES)
    if unknown or "bf16" not in args.schemes:
        parser.error(
            f"--schemes: bf16 and any of {SCHEMES}; unknown: {sorted(unknown)}"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = load_config(args.config)
    by_tp = {tp: projections(config, tp) for tp in args.tp}
    for tp, projs in by_tp.items():
        for set_name, members in target_sets(projs).items():
            print(f"# TP{tp} {set_name}: {sum(p.count for p in members)} projections")
        for p in projs:
            print(f"#   {p.name}: {p.count} x [{p.n}, {p.k}]")
    if args.shapes_only:
        return 0

    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    v = load_vllm()
    device = torch.cuda.get_device_name()
    print(f"# {device}, torch {torch.__version__}, schemes {args.schemes}", flush=True)
    measured = measure(v, distinct_shapes(by_tp), args)
    tables, sums = report_tables(by_tp, measured, args.schemes, args.m)
    print(tables)
    if args.json:
        report = {
            "device": device,
            "torch": torch.__version__,
            "args": {k: str(val) for k, val in vars(args).items()},
            "kernels": KERNELS,
            "projections": {tp: [asdict(p) for p in ps] for tp, ps in by_tp.items()},
            "measured": measured,
            "sums": sums,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
