# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Decode attention at GLM-5.3-Flash's geometry: BF16 vs fp8_ds_mla on SM90.

Times vLLM's own kernels, called the way `FlashMLASparseImpl` calls them:

* fp8: FlashMLA's sparse fp8 decode (`flash_mla_with_kvcache`,
  `is_fp8_kvcache=True`) over 656-byte rows written by vLLM's cache writer
  (`concat_and_cache_mla`, `fp8_ds_mla`, zero-width `k_pe`), the query
  zero-padded 512 -> 576, heads padded by vLLM's rule, and below
  `MIN_HEADS_FOR_BF16_PREFILL` heads the backend's "mixed batch" layout;
* bf16: FlashMLA's BF16 sparse kernel (`flash_mla_sparse_fwd`) over a
  512-wide bf16 cache, heads padded (or not, on SM90's small-head kernel) by
  vLLM's rule, with `topk_length` as the backend passes it.

Each decode token is one request (one query token) whose indexer picked 2051
of its context tokens (top-k 2048 + 3 tail), padded with -1 to GLM's buffer
width (2176). vLLM's rules are read from its source files, so this runs on a
stub `vllm/__init__.py` beside the wheel's files as well as on an installed
vLLM. Times are kernel-only (CUDA events around each call), the median of all
calls of a configuration; fp8 and bf16 calls alternate within each round so
that drifting clocks hit both, and the rounds are repeated (`--rounds`); the
table gives the median ratio and its range over the rounds. By default the L2
cache is flushed before every call ("cold", as between a model's layers) and
each configuration is timed once more without the flush ("hot").

FLASHINFER_MLA_SPARSE_SM90, the BF16 default for GLM on SM90, is not timed
here: it needs FlashInfer (its JIT-compiled FA3 MLA kernels), which this
script does not install; `--json` records whether `flashinfer` was importable.
"""

import argparse
import ast
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

KV_LORA_RANK = 512
QK_WIDTH = 576  # fp8_ds_mla rows keep DeepSeek's 576 layout
ROW_BYTES = 656
BLOCK_SIZE = 64
NUM_HEADS = 64
INDEX_TOPK = 2048
INDEX_KPOOL = 4
NUM_SELECTED = INDEX_TOPK + INDEX_KPOOL - 1  # 2051
SOFTMAX_SCALE = 256**-0.5  # GLM's qk_head_dim ** -0.5
L2_FLUSH_BYTES = 256 << 20


def from_vllm_source(
    relpath: str, names: tuple[str, ...], namespace: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Named functions/constants of a vLLM module, compiled from its source.

    Annotations and decorators are dropped, so methods come back unbound and
    nothing else of vLLM is imported. Raises KeyError naming what is missing.
    """
    import vllm

    path = Path(vllm.__file__).parent / relpath
    tree = ast.parse(path.read_text(), filename=str(path))
    found: dict[str, ast.stmt] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            node.returns = None
            for arg in (*node.args.args, *node.args.kwonlyargs):
                arg.annotation = None
            found.setdefault(node.name, node)
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id in names
        ):
            found.setdefault(node.targets[0].id, node)
    missing = set(names) - found.keys()
    if missing:
        raise KeyError(f"{relpath} does not define {sorted(missing)}")
    scope = dict(namespace or {})
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    exec(compile(module, str(path), "exec"), scope)
    return {n: scope[n] for n in names}


def load_vllm() -> SimpleNamespace:
    """The kernels of vLLM and the FlashMLA-sparse rules this benchmark follows."""
    import vllm._C_stable_libtorch  # noqa: F401  (registers _C_cache_ops)
    from vllm.third_party.flashmla import flash_mla_interface as fm

    backend_py = "v1/attention/backends/mla/flashmla_sparse.py"
    backend = from_vllm_source(
        backend_py, ("MIN_HEADS_FOR_BF16_PREFILL", "_compute_fp8_decode_padded_heads")
    )
    math_utils = from_vllm_source("utils/math_utils.py", ("round_up",))
    glm = from_vllm_source(
        "models/glm5next/common/model.py", ("get_sparse_topk_buffer_width",), math_utils
    )
    major, minor = torch.cuda.get_device_capability()
    platform = SimpleNamespace(
        is_device_capability_family=lambda family: major * 10 == family
    )
    try:
        small_head = from_vllm_source(
            backend_py,
            ("_should_use_bf16_small_head_kernel",),
            {"current_platform": platform},
        )["_should_use_bf16_small_head_kernel"]
    except KeyError:  # older vLLM: no small-head BF16 kernel, always pad
        small_head = None
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    return SimpleNamespace(
        cache_ops=torch.ops._C_cache_ops,
        fm=fm,
        fp8_padded_heads=backend["_compute_fp8_decode_padded_heads"],
        min_heads_bf16_prefill=backend["MIN_HEADS_FOR_BF16_PREFILL"],
        round_up=math_utils["round_up"],
        topk_width=glm["get_sparse_topk_buffer_width"](
            SimpleNamespace(index_topk=INDEX_TOPK, index_kpool=INDEX_KPOOL)
        ),
        bf16_small_head=(
            (lambda n, h: small_head(SimpleNamespace(_sm_count=sm_count), n, h))
            if small_head
            else (lambda n, h: False)
        ),
    )


def bf16_heads(v: SimpleNamespace, tokens: int, heads: int) -> int:
    """Heads the BF16 sparse kernel sees (vLLM's `_bf16_flash_mla_kernel`)."""
    if v.bf16_small_head(tokens, heads):
        return heads
    return v.round_up(heads, 64)


def make_case(v: SimpleNamespace, tokens: int, heads: int, ctx: int, seed: int):
    """Caches, indices and queries for `tokens` one-token decode requests."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_req = -(-ctx // BLOCK_SIZE)
    rows = tokens * blocks_per_req * BLOCK_SIZE
    kv_c = torch.randn(rows, KV_LORA_RANK, generator=gen, device="cuda")
    kv_c = kv_c.to(torch.bfloat16)
    fp8_cache = torch.full(
        (rows // BLOCK_SIZE, BLOCK_SIZE, ROW_BYTES),
        0xFF,
        dtype=torch.uint8,
        device="cuda",
    )
    v.cache_ops.concat_and_cache_mla(
        kv_c,
        kv_c.new_empty((rows, 0)),
        fp8_cache,
        torch.arange(rows, device="cuda"),
        "fp8_ds_mla",
        torch.ones(1, device="cuda"),
        False,
    )
    idx = torch.full((tokens, v.topk_width), -1, dtype=torch.int32, device="cuda")
    pick = torch.rand(tokens, ctx, generator=gen, device="cuda").argsort(dim=1)
    base = torch.arange(tokens, device="cuda")[:, None] * blocks_per_req * BLOCK_SIZE
    idx[:, :NUM_SELECTED] = (pick[:, :NUM_SELECTED] + base).int()
    q = torch.randn(tokens, heads, KV_LORA_RANK, generator=gen, device="cuda")
    q = (q * 0.05).to(torch.bfloat16)
    return kv_c, fp8_cache, idx, q


def fp8_call(v: SimpleNamespace, q, fp8_cache, idx):
    """The fp8 decode call of `FlashMLASparseImpl` (pure decode batch)."""
    tokens, heads, _ = q.shape
    padded = v.fp8_padded_heads(heads)
    shape = (1, tokens) if heads < v.min_heads_bf16_prefill else (tokens, 1)
    qp = q.new_zeros((tokens, padded, QK_WIDTH))
    qp[:, :heads, :KV_LORA_RANK] = q
    qp = qp.view(*shape, padded, QK_WIDTH)
    k_cache = fp8_cache.unsqueeze(-2)
    ind = idx.view(*shape, -1)
    meta, _ = v.fm.get_mla_metadata()

    def run() -> torch.Tensor:
        out, _ = v.fm.flash_mla_with_kvcache(
            qp,
            k_cache,
            None,
            None,
            KV_LORA_RANK,
            meta,
            None,
            softmax_scale=SOFTMAX_SCALE,
            is_fp8_kvcache=True,
            indices=ind,
        )
        return out.reshape(tokens, padded, KV_LORA_RANK)[:, :heads]

    return run, padded


def bf16_call(v: SimpleNamespace, q, kv_c, idx):
    """The BF16 sparse call of `FlashMLASparseImpl._bf16_flash_mla_kernel`."""
    tokens, heads, _ = q.shape
    padded = bf16_heads(v, tokens, heads)
    qp = q.new_zeros((tokens, padded, KV_LORA_RANK))
    qp[:, :heads] = q
    kv = kv_c.view(-1, 1, KV_LORA_RANK)
    ind = idx.view(tokens, 1, -1)
    length = torch.full((tokens,), NUM_SELECTED, dtype=torch.int32, device="cuda")

    def run() -> torch.Tensor:
        out = v.fm.flash_mla_sparse_fwd(
            qp, kv, ind, SOFTMAX_SCALE, KV_LORA_RANK, topk_length=length
        )[0]
        return out[:, :heads]

    return run, padded


def time_pair(fns, rounds: int, iters: int, warmup: int, flush: torch.Tensor | None):
    """Per round, the median microseconds of each fn; calls alternate."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        events = [[] for _ in fns]
        for it in range(iters):
            order = range(len(fns)) if it % 2 == 0 else reversed(range(len(fns)))
            for k in order:
                if flush is not None:
                    flush.zero_()
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                fns[k]()
                e1.record()
                events[k].append((e0, e1))
        torch.cuda.synchronize()
        per_round.append(
            [statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev) for ev in events]
        )
    return per_round


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--tp", default="1,8", help="tensor-parallel sizes")
    parser.add_argument("--ctx", type=int, default=8192, help="context per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--l2", default="cold,hot", help="cold (flush), hot, both")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    v = load_vllm()
    try:
        import flashinfer  # noqa: F401

        flashinfer_state = f"importable ({getattr(flashinfer, '__version__', '?')})"
    except Exception as exc:
        flashinfer_state = f"not importable: {type(exc).__name__}: {exc}"
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"top-k {NUM_SELECTED} padded to {v.topk_width}, ctx {args.ctx}/request, "
        f"{args.rounds} rounds x {args.iters} calls, kernel-only CUDA-event times"
    )
    print(f"# FLASHINFER_MLA_SPARSE_SM90: not timed; flashinfer {flashinfer_state}")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    results = []
    for l2 in args.l2.split(","):
        print(
            f"\n## L2 {l2}\n"
            f"{'tp':>3} {'heads':>5} {'fp8/bf16 pad':>12} {'tokens':>6} "
            f"{'fp8 us':>8} {'bf16 us':>8} {'fp8/bf16':>8} {'ratio range':>13} "
            f"{'rel diff':>8}"
        )
        for tp in (int(t) for t in args.tp.split(",")):
            heads = NUM_HEADS // tp
            for tokens in (int(t) for t in args.tokens.split(",")):
                kv_c, fp8_cache, idx, q = make_case(v, tokens, heads, args.ctx, tokens)
                f8, f8_pad = fp8_call(v, q, fp8_cache, idx)
                bf, bf_pad = bf16_call(v, q, kv_c, idx)
                diff = (
                    (f8().float() - bf().float()).norm() / bf().float().norm()
                ).item()
                rounds = time_pair(
                    [f8, bf],
                    args.rounds,
                    args.iters,
                    args.warmup,
                    flush if l2 == "cold" else None,
                )
                ratios = [a / b for a, b in rounds]
                fp8_us = statistics.median(r[0] for r in rounds)
                bf16_us = statistics.median(r[1] for r in rounds)
                row = {
                    "l2": l2,
                    "tp": tp,
                    "heads": heads,
                    "fp8_padded_heads": f8_pad,
                    "bf16_padded_heads": bf_pad,
                    "tokens": tokens,
                    "fp8_us": fp8_us,
                    "bf16_us": bf16_us,
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "rounds_us": rounds,
                    "rel_diff_fp8_vs_bf16": diff,
                }
                results.append(row)
                print(
                    f"{tp:>3} {heads:>5} {f'{f8_pad}/{bf_pad}':>12} {tokens:>6} "
                    f"{fp8_us:>8.1f} {bf16_us:>8.1f} {row['ratio']:>8.2f} "
                    f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>13} {diff:>8.4f}",
                    flush=True,
                )
                del kv_c, fp8_cache, idx, q, f8, bf
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "topk_width": v.topk_width,
                    "ctx": args.ctx,
                    "flashinfer": flashinfer_state,
                    "results": results,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
