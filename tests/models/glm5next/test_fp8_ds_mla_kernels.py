# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5.3-Flash's fp8_ds_mla rows through vLLM's own SM90 kernels.

GLM-5.3-Flash is a NoPE MLA model: a 512-wide latent, no RoPE, 64 heads. With
`--kv-cache-dtype fp8` on SM90 its rows take FlashMLA's 656-byte `fp8_ds_mla`
layout: 512 e4m3 values, 4 float32 scales (one per 128 values) and a 64-value
bf16 RoPE slot that GLM leaves empty. These tests drive the kernels that serve
those rows, never a reimplementation of them:

* the cache writer `torch.ops._C_cache_ops.concat_and_cache_mla` with a
  zero-width `k_pe`, as GLM's attention layer calls it;
* FlashMLA's sparse fp8 decode (`flash_mla_with_kvcache(is_fp8_kvcache=True)`)
  through vLLM's vendored interface `vllm.third_party.flashmla`;
* the prefill path of `FlashMLASparseImpl`: the upconvert op
  `torch.ops._C_cache_ops.cp_gather_and_upconvert_fp8_kv_cache`, then
  FlashMLA's BF16 sparse kernel `flash_mla_sparse_fwd` over the upconverted
  576-wide rows.

vLLM's padding rules (heads for the fp8 decode kernel, the mixed-batch cutoff,
GLM's top-k buffer width) are read from vLLM's own source files, so the tests
follow whatever the installed vLLM does. They import only the compiled
extensions and the FlashMLA interface, so they also run against a stub
`vllm/__init__.py` beside the wheel's files (no vLLM dependencies needed).
"""

import ast
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs an SM90 GPU: these tests pin FlashMLA's SM90 fp8_ds_mla kernels",
)

KV_LORA_RANK = 512  # GLM-5.3-Flash's latent width (kv_lora_rank)
ROPE_SLOT = 64  # bf16 RoPE values in an fp8_ds_mla row, unused by a NoPE model
QK_WIDTH = KV_LORA_RANK + ROPE_SLOT  # 576: the query is zero-padded to this
ROW_BYTES = 656  # 512 e4m3 + 4 float32 scales + 64 bf16
SCALES_AT = KV_LORA_RANK  # byte offset of the 4 float32 scales
ROPE_AT = KV_LORA_RANK + 16  # byte offset of the RoPE slot
TILE = 128  # values per scale
BLOCK_SIZE = 64  # the only page size FlashMLA sparse takes
NUM_HEADS = 64  # GLM-5.3-Flash's attention heads (TP1)
INDEX_TOPK = 2048  # GLM's sparse indexer top-k
INDEX_KPOOL = 4  # kpool 4: up to 3 always-selected tail tokens
NUM_SELECTED = INDEX_TOPK + INDEX_KPOOL - 1  # 2051 real selections
# The model's own softmax scale: qk_head_dim ** -0.5 with qk_head_dim 256,
# not the kernel's default of 576 ** -0.5.
SOFTMAX_SCALE = 256**-0.5
E4M3_MAX = 448.0
E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: round-to-nearest error <= 2^-4 |x|
E4M3_HALF_MIN_SUBNORMAL = 2.0**-10  # smallest subnormal is 2^-9
BF16_NAN = 0x7FC0

TP_CASES = [
    pytest.param(tp, NUM_HEADS // tp, id=f"tp{tp}-heads{NUM_HEADS // tp}")
    for tp in (1, 2, 4, 8)
]


# --------------------------------------------------------------------------
# vLLM's own code
# --------------------------------------------------------------------------


def _from_vllm_source(
    relpath: str, names: tuple[str, ...], namespace: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Functions and constants of a vLLM module, taken from its source file.

    Importing the module would import the whole of vLLM; this compiles only
    the named definitions (methods too, unbound), with their annotations and
    decorators dropped, in `namespace`.
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
    assert not missing, f"{relpath} no longer defines {sorted(missing)}"
    scope = dict(namespace or {})
    module = ast.Module(body=[found[n] for n in names], type_ignores=[])
    exec(compile(module, str(path), "exec"), scope)
    return {n: scope[n] for n in names}


@pytest.fixture(scope="module")
def kernels() -> SimpleNamespace:
    """The compiled cache ops of vLLM and its FlashMLA interface."""
    import vllm._C_stable_libtorch  # noqa: F401  (registers _C_cache_ops)
    from vllm.third_party.flashmla import flash_mla_interface

    return SimpleNamespace(cache=torch.ops._C_cache_ops, flashmla=flash_mla_interface)


@pytest.fixture(scope="module")
def rules() -> SimpleNamespace:
    """The padding rules of vLLM's FlashMLA sparse backend, GLM's top-k width."""
    backend = _from_vllm_source(
        "v1/attention/backends/mla/flashmla_sparse.py",
        ("MIN_HEADS_FOR_BF16_PREFILL", "_compute_fp8_decode_padded_heads"),
    )
    math_utils = _from_vllm_source("utils/math_utils.py", ("round_up",))
    glm = _from_vllm_source(
        "models/glm5next/common/model.py",
        ("get_sparse_topk_buffer_width",),
        math_utils,
    )
    config = SimpleNamespace(index_topk=INDEX_TOPK, index_kpool=INDEX_KPOOL)
    return SimpleNamespace(
        fp8_decode_padded_heads=backend["_compute_fp8_decode_padded_heads"],
        min_heads_for_bf16_prefill=backend["MIN_HEADS_FOR_BF16_PREFILL"],
        topk_width=glm["get_sparse_topk_buffer_width"](config),
        round_up=math_utils["round_up"],
    )


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _latents(num_tokens: int, seed: int) -> torch.Tensor:
    """bf16 latents with per-tile magnitudes that differ by orders of size."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(num_tokens, KV_LORA_RANK, generator=gen, device="cuda")
    tile_gain = torch.tensor([0.05, 0.7, 3.0, 40.0], device="cuda")
    x = x.view(num_tokens, -1, TILE) * tile_gain[None, :, None]
    x[:, :, ::29] *= 6  # a few outliers per tile
    return x.reshape(num_tokens, KV_LORA_RANK).to(torch.bfloat16)


def _write(kernels: SimpleNamespace, kv_c: torch.Tensor, cache, slots) -> None:
    """GLM's cache write: the latent with a zero-width k_pe, fp8_ds_mla."""
    k_pe = kv_c.new_empty((kv_c.shape[0], 0))
    scale = torch.ones(1, dtype=torch.float32, device=kv_c.device)
    kernels.cache.concat_and_cache_mla(
        kv_c, k_pe, cache, slots.long(), "fp8_ds_mla", scale, False
    )


def _new_cache(num_blocks: int) -> torch.Tensor:
    """A paged fp8_ds_mla cache filled with 0xFF (bf16 NaN in the RoPE slot)."""
    return torch.full(
        (num_blocks, BLOCK_SIZE, ROW_BYTES), 0xFF, dtype=torch.uint8, device="cuda"
    )


def _codes_and_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 values (as float32, [N, 4, 128]) and scales ([N, 4]) of rows."""
    codes = rows[:, :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[:, SCALES_AT:ROPE_AT].contiguous().view(torch.float32)
    return codes.view(-1, KV_LORA_RANK // TILE, TILE), scales


def _dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Rows' latents as the writer's own scales give them back, float32."""
    codes, scales = _codes_and_scales(rows)
    return (codes * scales.unsqueeze(-1)).view(-1, KV_LORA_RANK)


def _paged_requests(ctx_lens: list[int], seed: int):
    """Block tables for requests over shuffled physical blocks.

    Returns (block_table [R, max_blocks] int32, slots per request (int64),
    number of physical blocks).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [math.ceil(n / BLOCK_SIZE) for n in ctx_lens]
    perm = torch.randperm(sum(blocks) + 3, generator=gen)  # 3 blocks never used
    table = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
    slots, start = [], 0
    for r, (n, nb) in enumerate(zip(ctx_lens, blocks)):
        table[r, :nb] = perm[start : start + nb].int()
        start += nb
        pos = torch.arange(n)
        slots.append(table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    return table.cuda(), [s.cuda() for s in slots], perm.numel()


def _select(
    slots: torch.Tensor, num_queries: int, width: int, seed: int
) -> torch.Tensor:
    """Each query's 2051 distinct selections, padded with -1 to `width`."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pool = slots.cpu()
    idx = torch.full((num_queries, width), -1, dtype=torch.int32)
    for i in range(num_queries):
        pick = torch.randperm(pool.numel(), generator=gen)[:NUM_SELECTED]
        idx[i, :NUM_SELECTED] = pool[pick].int()
    return idx.cuda()


def _reference(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """fp32 sparse attention: q [N, H, 512], kv [rows, 512], idx [N, K].

    Padding slots (-1) are masked out of the softmax and zeroed, so rows the
    selection never names (0xFF, NaN once dequantized) cannot leak in.
    """
    valid = idx >= 0
    k = kv[idx.clamp(min=0).long()]  # [N, K, 512]
    k = k.masked_fill(~valid[..., None], 0.0)
    logits = torch.einsum("nhd,nkd->nhk", q.float(), k) * SOFTMAX_SCALE
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("nhk,nkd->nhd", logits.softmax(-1), k)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def _pad_query(q: torch.Tensor, heads: int) -> torch.Tensor:
    """The query [..., H, 512] zero-padded to [..., heads, 576], as vLLM does."""
    out = q.new_zeros((*q.shape[:-2], heads, QK_WIDTH))
    out[..., : q.shape[-2], :KV_LORA_RANK] = q
    return out


def _fp8_decode(
    kernels: SimpleNamespace,
    rules: SimpleNamespace,
    q: torch.Tensor,
    cache: torch.Tensor,
    idx: torch.Tensor,
    num_reqs: int,
) -> torch.Tensor:
    """FlashMLA's sparse fp8 decode as FlashMLASparseImpl calls it.

    q [N, H, 512] bf16, one row per query token, `num_reqs` requests of N /
    num_reqs tokens each; idx [N, topk_width] physical slots. Below vLLM's
    MIN_HEADS_FOR_BF16_PREFILL heads the backend runs the "mixed batch" (every
    token one batch row of one request); above it, one batch row per request.
    Returns [N, H, 512].
    """
    tokens, heads = q.shape[:2]
    padded = rules.fp8_decode_padded_heads(heads)
    if heads < rules.min_heads_for_bf16_prefill:
        shape = (1, tokens)
    else:
        shape = (num_reqs, tokens // num_reqs)
    q4 = _pad_query(q, padded).view(*shape, padded, QK_WIDTH)
    meta, _ = kernels.flashmla.get_mla_metadata()
    out, _ = kernels.flashmla.flash_mla_with_kvcache(
        q4,
        cache.view(torch.uint8).unsqueeze(-2),
        None,
        None,
        KV_LORA_RANK,
        meta,
        None,
        softmax_scale=SOFTMAX_SCALE,
        is_fp8_kvcache=True,
        indices=idx.view(*shape, -1),
    )
    return out.reshape(tokens, padded, KV_LORA_RANK)[:, :heads]


def _decode_case(kernels, rules, heads: int, num_q: int, seed: int):
    """Two requests of 2304 tokens written by the writer, and their queries.

    Returns (cache, idx [N, width], q [N, heads, 512], num_reqs).
    """
    ctx_lens = [2304, 2304]
    _, slots, num_blocks = _paged_requests(ctx_lens, seed)
    cache = _new_cache(num_blocks)
    for r, s in enumerate(slots):
        _write(kernels, _latents(s.numel(), seed + r), cache, s)
    idx = torch.cat(
        [
            _select(s, num_q, rules.topk_width, seed + 10 + r)
            for r, s in enumerate(slots)
        ]
    )
    gen = torch.Generator(device="cuda").manual_seed(seed + 99)
    q = torch.randn(idx.shape[0], heads, KV_LORA_RANK, generator=gen, device="cuda")
    return cache, idx, (q * 0.05).to(torch.bfloat16), len(ctx_lens)


# --------------------------------------------------------------------------
# vLLM's rules, as these tests read them
# --------------------------------------------------------------------------


def test_topk_width_is_2051_rounded_to_128(rules):
    """GLM's top-k buffer: 2048 + 3 tail slots, padded to 2176."""
    assert rules.topk_width == 2176


# --------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def written(kernels):
    """Half the slots of a 0xFF-filled cache written by the writer."""
    num_blocks = 40
    gen = torch.Generator(device="cpu").manual_seed(7)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:1280]
    slots = slots.sort().values.cuda()
    kv_c = _latents(slots.numel(), seed=7)
    cache = _new_cache(num_blocks)
    _write(kernels, kv_c, cache, slots)
    torch.cuda.synchronize()
    flat = cache.view(-1, ROW_BYTES)
    return SimpleNamespace(flat=flat, slots=slots, kv_c=kv_c, rows=flat[slots])


def test_writer_zeroes_the_rope_slot(written):
    """Every written row's 64-value RoPE slot is zero, over a 0xFF cache."""
    assert (written.rows[:, ROPE_AT:] == 0).all()


def test_writer_leaves_other_rows_untouched(written):
    keep = torch.ones(written.flat.shape[0], dtype=torch.bool, device="cuda")
    keep[written.slots] = False
    assert (written.flat[keep] == 0xFF).all()


def test_writer_scales_fit_their_tiles(written):
    """The row's own scales: finite, positive, and sized to the tile.

    No formula is assumed (vLLM's are not amax / 448): the tile's largest
    magnitude, divided by its scale, stays within e4m3's range and uses at
    least its top two binades, and every stored value is finite.
    """
    codes, scales = _codes_and_scales(written.rows)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    assert torch.isfinite(codes).all()
    amax = written.kv_c.float().view(-1, KV_LORA_RANK // TILE, TILE).abs().amax(-1)
    used = amax / scales
    assert used.max().item() <= E4M3_MAX * (1 + E4M3_HALF_ULP)
    assert used.min().item() >= E4M3_MAX / 4


def test_writer_round_trip_within_e4m3_bound(written):
    """Dequantized with the row's scales, each value is within half an e4m3
    step of the bf16 input (relative 2^-4, or half the smallest subnormal)."""
    _, scales = _codes_and_scales(written.rows)
    x = written.kv_c.float()
    err = (_dequantize(written.rows) - x).abs()
    step = scales.repeat_interleave(TILE, dim=1) * E4M3_HALF_MIN_SUBNORMAL
    bound = (E4M3_HALF_ULP * x.abs() + step) * (1 + 1e-5)
    worst = (err - bound).max().item()
    assert worst <= 0, f"round trip exceeds e4m3's bound by {worst}"


# --------------------------------------------------------------------------
# Sparse fp8 decode over the writer's rows
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_q", [1, 2, 4], ids=lambda n: f"q{n}"
)  # 1 decode token, and MTP verification (1 and 3 draft tokens)
@pytest.mark.parametrize("tp,heads", TP_CASES)
def test_fp8_sparse_decode_matches_reference(kernels, rules, tp, heads, num_q):
    """FlashMLA's fp8 decode over written rows, heads padded as vLLM pads
    them, equals fp32 attention over the rows' dequantized values."""
    cache, idx, q, num_reqs = _decode_case(kernels, rules, heads, num_q, seed=tp)
    out = _fp8_decode(kernels, rules, q, cache, idx, num_reqs)
    ref = _reference(q, _dequantize(cache.view(-1, ROW_BYTES)), idx)
    assert not torch.isnan(out).any()
    assert _rel(out, ref) < 5e-3


def test_nan_in_rope_slot_poisons_fp8_decode(kernels, rules):
    """With the query's pad zero, NaN bytes in the RoPE slot still make the
    decode NaN (0 x NaN): the writer's zeroing of the slot is load-bearing."""
    cache, idx, q, num_reqs = _decode_case(kernels, rules, NUM_HEADS, 1, seed=11)
    assert torch.isfinite(_fp8_decode(kernels, rules, q, cache, idx, num_reqs)).all()
    rope = cache.view(-1, ROW_BYTES)[:, ROPE_AT:]
    nan = torch.full(
        (rope.shape[0], ROPE_SLOT), BF16_NAN, dtype=torch.int16, device="cuda"
    )
    rope.copy_(nan.view(torch.uint8))
    out = _fp8_decode(kernels, rules, q, cache, idx, num_reqs)
    assert torch.isnan(out).all()


# --------------------------------------------------------------------------
# Prefill: upconvert, then the BF16 sparse kernel
# --------------------------------------------------------------------------


def _upconverted(kernels, seed: int):
    """Three requests written by the writer, then gathered and upconverted
    by `cp_gather_and_upconvert_fp8_kv_cache` as FlashMLASparseImpl does.

    Returns (workspace [tokens, 576] bf16, the written rows in workspace
    order [tokens, 656], request lengths).
    """
    ctx_lens = [2304, 100, 64]
    table, slots, num_blocks = _paged_requests(ctx_lens, seed)
    cache = _new_cache(num_blocks)
    for r, s in enumerate(slots):
        _write(kernels, _latents(s.numel(), seed + r), cache, s)
    starts = torch.tensor([0, *torch.tensor(ctx_lens).cumsum(0)[:-1].tolist()])
    workspace = torch.full(
        (sum(ctx_lens), QK_WIDTH), float("nan"), dtype=torch.bfloat16, device="cuda"
    )
    kernels.cache.cp_gather_and_upconvert_fp8_kv_cache(
        cache,
        workspace,
        table,
        starts.to(device="cuda", dtype=torch.int32),
        len(ctx_lens),
        None,
        None,
        None,
        None,
    )
    rows = cache.view(-1, ROW_BYTES)[torch.cat(slots)]
    return workspace, rows, ctx_lens


def test_prefill_upconvert_gives_writer_values(kernels):
    """The upconverted latents are the writer's dequantized values (bf16)."""
    workspace, rows, _ = _upconverted(kernels, seed=21)
    torch.testing.assert_close(
        workspace[:, :KV_LORA_RANK].float(),
        _dequantize(rows).to(torch.bfloat16).float(),
        rtol=2**-7,
        atol=0.0,
    )


def test_prefill_upconvert_rope_part_is_zero(kernels):
    workspace, _, _ = _upconverted(kernels, seed=22)
    assert (workspace[:, KV_LORA_RANK:] == 0).all()


# Below MIN_HEADS_FOR_BF16_PREFILL heads (TP4, TP8) vLLM prefills through the
# fp8 decode kernel ("mixed batch"), which the decode tests cover.
@pytest.mark.parametrize("tp,heads", TP_CASES[:2])
def test_bf16_prefill_over_upconverted_rows_matches_reference(
    kernels, rules, tp, heads
):
    """FlashMLA's BF16 sparse kernel over the upconverted rows equals fp32
    attention over the writer's dequantized values. vLLM takes this path from
    MIN_HEADS_FOR_BF16_PREFILL heads up and pads heads to a multiple of 64."""
    assert heads >= rules.min_heads_for_bf16_prefill, (
        f"vLLM now prefills {heads} heads through the fp8 decode kernel"
    )
    workspace, rows, ctx_lens = _upconverted(kernels, seed=30 + tp)
    num_q = 5
    # indices are workspace offsets into the first (2304-token) request
    idx = _select(
        torch.arange(ctx_lens[0], device="cuda"), num_q, rules.topk_width, seed=tp
    )
    gen = torch.Generator(device="cuda").manual_seed(tp)
    q = torch.randn(num_q, heads, KV_LORA_RANK, generator=gen, device="cuda")
    q = (q * 0.05).to(torch.bfloat16)
    padded = rules.round_up(heads, 64)
    out, _, _ = kernels.flashmla.flash_mla_sparse_fwd(
        _pad_query(q, padded),
        workspace.view(-1, 1, QK_WIDTH),
        idx.view(num_q, 1, -1),
        SOFTMAX_SCALE,
        KV_LORA_RANK,
        topk_length=torch.full(
            (num_q,), NUM_SELECTED, dtype=torch.int32, device="cuda"
        ),
    )
    ref = _reference(q, _dequantize(rows), idx)
    assert not torch.isnan(out).any()
    assert _rel(out[:, :heads], ref) < 5e-3
