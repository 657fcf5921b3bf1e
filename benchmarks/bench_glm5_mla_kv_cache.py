# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5.3-Flash's MLA KV-cache layouts on SM90: decode time and accuracy.

Every path is a kernel vLLM runs (or, for one row, could run), called the way
its backend calls it, over rows written by vLLM's own cache writer
(`concat_and_cache_mla`, zero-width `k_pe`, as GLM's NoPE layers write them):

* `fi_bf16`: FLASHINFER_MLA_SPARSE_SM90 with a BF16 cache (1024-byte rows),
  the default for GLM on SM90: FlashInfer's `BatchMLAPagedAttentionWrapper`,
  backend `fa3`, page size 1 (the top-k slots are the page table),
  `head_dim_kpe=0`, not causal, one plan row per decode token;
* `fi_fp8`: the same backend with `--kv-cache-dtype fp8` on pristine vLLM:
  512-byte E4M3 rows written with one per-tensor scale (`ckv_scale`);
* `fi_fp8_g128`: the same kernel with the per-token x 128-channel scale
  array (`ckv_scale_arr`) FlashInfer supports and vLLM has not wired, fed with
  the E4M3 values and scales of vLLM's `fp8_ds_mla` writer (a 528-byte row);
* `flashmla_fp8`: FLASHMLA_SPARSE with `fp8_ds_mla` (656-byte rows), FlashMLA's
  sparse fp8 decode, query zero-padded 512 -> 576, heads padded by vLLM's rule;
* `flashmla_bf16`: FLASHMLA_SPARSE's BF16 sparse kernel (`flash_mla_sparse_fwd`)
  over a 512-wide BF16 cache.

Each decode token is one request whose indexer picked 2051 of its context
tokens (top-k 2048 + 3 tail), padded with -1 to GLM's buffer width for FlashMLA
and packed (valid prefix only) for FlashInfer, as vLLM hands them over.

`decode` times all paths in one run: kernel-only CUDA-event times, calls of the
paths alternating within each round, the L2 cache flushed before every call
("cold", as between a model's layers); the table gives the median and each
ratio's range over the rounds. `accuracy` measures each layout's attention
output against an fp32 reference computed from the BF16 latent, per (token,
head) relative error, over synthetic latents shaped like an RMS-normalized MLA
latent (per-channel scale spread, outlier channels, a few tokens of large
norm). They are synthetic: they stand for no checkpoint's latents.

`prefill` (issue 43 item 4) times one scheduler step of `--prefill-tokens`
(vLLM's `max_num_batched_tokens`) prefill tokens of 2K, 8K or 32K prompts (the
last chunk of a longer one) at 8 and 16 heads, each token attending its 2051
selected context tokens (fewer, causal-valid, below position 2051), -1 padded
to 2176: (a) what FLASHMLA_SPARSE does at fewer than 32 heads
(`_forward_fp8_kv_mixed_batch`): every token through the fp8 decode kernel,
query zero-padded to 64 heads and 576 wide (the pad timed apart), and, where
the tree defines `FP8_MIXED_BATCH_CHUNK` (the series' workspace fix), the same
kernel over chunks of that many tokens padded in a workspace, as its
`_fp8_mixed_batch_kernel` runs them (`a_chunked`, pad and copies included);
against (b)
`_forward_fp8_kv_separate_prefill_decode`'s prefill: per workspace chunk
(vLLM's `split_prefill_chunks`, `max_model_len` x 5 rows),
`cp_gather_and_upconvert_fp8_kv_cache` into BF16, then `flash_mla_sparse_fwd`
at 8/16 heads unpadded (vLLM's small-head rule) with `topk_length`. Index
conversion (the same Triton kernel in both) and the output copy are left out.

`gain-sweep` (issue 44 item 16) runs the accuracy table over latents shaped
as `kv_a_layernorm`'s output, `rmsnorm(z) * gamma` (so `|x_i| <= sqrt(512) *
|gamma_i|`), over gains from 0.01 to 30 with a few outlier channels, and adds
per layout the fraction of E4M3 values saturated (`|v / scale| > 448`) and in
E4M3's subnormal range (`< 2**-6`), then says where each layout loses accuracy.

`head512` (issue 46) times FlashMLA's SM90 sparse decode for a 512-wide head
(`flashmla_v4`: DeepSeek-V4's 584-byte rows, 448 E4M3 values with 7 ue8m0
scales per 64 and 64 BF16 values, a page of 64 data rows then 64 scale rows,
padded to the kernel's 576-byte stride) over GLM's latent written by vLLM's
own V4 writer (`_C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert` with an
identity RoPE; else its Triton `quantize_and_insert_k_cache`; else this file's
reference writer, the row says which) against `flashmla_fp8`, `fi_fp8` and
`fi_bf16` (`flashmla_v4_full`: the same without `topk_length`), plus its
accuracy rows on the `accuracy` latents. Query heads are padded to 64 as
DeepSeek-V4 pads them (the kernel takes 64 or 128); a probe first checks the
kernel runs GLM's shape and reads the rows as written (else one row says why).

Every path fails soft (its row carries the error); `--quick` shortens all
parts (under 4 minutes for `--parts all` on an H100). vLLM's kernels are found
through `import vllm`: the `gpu --bench` stage's stub package with the files
it copies, or a whole vLLM (`engine.py run patched -- python3 ...` of the
`gpu --engine` stage, FlashInfer's SM90 MLA modules beside it).
"""

import argparse
import ast
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

DEVICE = "cuda"
KV_LORA_RANK = 512
QK_WIDTH = 576  # fp8_ds_mla rows keep DeepSeek's 576 layout
DS_MLA_ROW_BYTES = 656
BLOCK_SIZE = 64
NUM_HEADS = 64
INDEX_TOPK = 2048
INDEX_KPOOL = 4
NUM_SELECTED = INDEX_TOPK + INDEX_KPOOL - 1  # 2051
SOFTMAX_SCALE = 256**-0.5  # GLM's qk_head_dim ** -0.5
L2_FLUSH_BYTES = 256 << 20
FI_WORKSPACE_BYTES = 128 << 20  # FLASHINFER_MLA_SPARSE_SM90's workspace
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
SATURATED = E4M3_MAX * 1.0001  # a per-block scale of amax/448 is not saturation

# DeepSeek-V4's fp8_ds_mla record (flash_mla_interface.py, cache_utils.py)
V4_FP8_DIM, V4_GROUP = 448, 64  # E4M3 values, one ue8m0 scale per 64
V4_SCALES = V4_FP8_DIM // V4_GROUP  # 7
V4_DATA_BYTES = V4_FP8_DIM + 2 * (KV_LORA_RANK - V4_FP8_DIM)  # 576: data row
V4_ROW_BYTES = V4_DATA_BYTES + V4_SCALES + 1  # 584: + 7 scales + 1 pad byte
# a page: 64 data rows, then 64 scale rows, padded to the 576-byte TMA stride
V4_BLOCK_STRIDE = -(-BLOCK_SIZE * V4_ROW_BYTES // V4_DATA_BYTES) * V4_DATA_BYTES
V4_LIMITS = (
    "SM90 sparse decode (flash_mla_with_kvcache, is_fp8_kvcache=True): h_q 64 or "
    "128 only, d_qk = d_v = 512 (q not padded to 576), rows of 584 bytes with "
    "k_cache.stride(1) == 584, block stride a multiple of 576, page block 64, "
    "top-k a multiple of 64; topk_length allowed (only V3.2's rows reject it)"
)

# GLM-5.3-Flash in vLLM's engine runs (docs/measurements.md)
MAX_NUM_BATCHED_TOKENS = 16384
MAX_MODEL_LEN = 32768
PREFILL_WORKSPACE_FACTOR = 5  # sparse_mla_prefill_workspace_factor's default

PATHS = ("fi_bf16", "fi_fp8", "fi_fp8_g128", "flashmla_fp8", "flashmla_bf16")
HEAD512_PATHS = ("fi_bf16", "fi_fp8", "flashmla_fp8", "flashmla_v4", "flashmla_v4_full")
ROW_BYTES = {
    "fi_bf16": 1024,
    "fi_fp8": 512,
    "fi_fp8_g128": 528,
    "flashmla_fp8": DS_MLA_ROW_BYTES,
    "flashmla_bf16": 1024,
    "flashmla_v4": V4_ROW_BYTES,
    "flashmla_v4_full": V4_ROW_BYTES,
}
WHAT = {
    "fi_bf16": "today's default (auto)",
    "fi_fp8": "today's fp8 (per-tensor)",
    "fi_fp8_g128": "FlashInfer, per-128 scales (not wired)",
    "flashmla_fp8": "fp8_ds_mla",
    "flashmla_bf16": "FlashMLA BF16 sparse",
    "flashmla_v4": "FlashMLA head-512 (DeepSeek-V4 584-byte rows), topk_length",
    "flashmla_v4_full": "the same without topk_length (all 2176 slots)",
}


SHORT = {"flashmla_fp8": "ds_mla", "flashmla_v4": "v4", "fi_bf16": "default"}


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def from_vllm_source(
    relpath: str, names: tuple[str, ...], namespace: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Named functions/constants of a vLLM module, compiled from its source.

    Annotations and decorators are dropped, so nothing else of vLLM is
    imported. Raises KeyError naming what is missing.
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


def split_chunks(seq_lens: torch.Tensor, workspace: int) -> list[tuple[int, int]]:
    """`split_prefill_chunks`' rule, for a stage without vLLM's utils.py."""
    bounds, i = [], 0
    while i < len(seq_lens):
        start, total = i, 0
        while i < len(seq_lens) and total + int(seq_lens[i]) <= workspace:
            total += int(seq_lens[i])
            i += 1
        bounds.append((start, i))
    return bounds


def load_vllm() -> SimpleNamespace:
    """The kernels of vLLM and the FlashMLA-sparse rules this benchmark follows.

    `import vllm` finds the `gpu --bench` stage's stub package or, under
    `engine.py run TREE --`, that tree's whole vLLM; both load the same
    extensions (`_C_stable_libtorch` registers `_C_cache_ops` and `_C`).
    """
    import vllm
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
    major, _ = torch.cuda.get_device_capability()
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
    try:  # the series' mixed batch in chunks (absent from the release)
        mixed_chunk = from_vllm_source(backend_py, ("FP8_MIXED_BATCH_CHUNK",))[
            "FP8_MIXED_BATCH_CHUNK"
        ]
    except KeyError:
        mixed_chunk = None
    try:
        split = from_vllm_source(
            "v1/attention/backends/utils.py",
            ("split_prefill_chunks",),
            {"torch": torch},
        )["split_prefill_chunks"]
    except (OSError, KeyError):  # the bench stage copies no utils.py
        split = split_chunks
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    return SimpleNamespace(
        vllm_dir=str(Path(vllm.__file__).parent),
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
        split_prefill_chunks=split,
        mixed_chunk=mixed_chunk,
        v4_loaded={"checked": set()},  # writer name -> its call; those checked
        v4_failed={},  # writer name -> its error
    )


def write_rows(v: SimpleNamespace, kv_c: torch.Tensor, dtype: str, scale: float):
    """`kv_c`'s rows as vLLM's cache writer stores them for `dtype`.

    A cache prefilled with 0xFF, so bytes the writer leaves alone would show.
    """
    rows = kv_c.shape[0]
    width = DS_MLA_ROW_BYTES if dtype == "fp8_ds_mla" else KV_LORA_RANK
    cache = torch.full(
        (rows // BLOCK_SIZE, BLOCK_SIZE, width), 0xFF, dtype=torch.uint8, device=DEVICE
    )
    v.cache_ops.concat_and_cache_mla(
        kv_c,
        kv_c.new_empty((rows, 0)),
        cache,
        torch.arange(rows, device=DEVICE),
        dtype,
        torch.tensor([scale], device=DEVICE),
        False,
    )
    return cache


def g128_from_ds_mla(ds_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The E4M3 values and the four fp32 scales of `fp8_ds_mla` rows, split
    into FlashInfer's `ckv` (rows x 512) and `ckv_scale_arr` (rows x 4)."""
    flat = ds_cache.view(-1, DS_MLA_ROW_BYTES)
    values = flat[:, :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn)
    scales = flat[:, KV_LORA_RANK : KV_LORA_RANK + 16].contiguous()
    return values, scales.view(torch.float32)


# DeepSeek-V4's 584-byte rows --------------------------------------------------
def v4_pack(kv_c: torch.Tensor) -> torch.Tensor:
    """The reference writer: `kv_c` (rows x 512, BF16) as V4 pages (blocks x
    V4_BLOCK_STRIDE bytes), quantized as vLLM's `quantize_and_insert_k_cache`:
    scale 2**ceil(log2(max(amax, 1e-4) / 448)) per 64 values, stored as its
    exponent + 127; the last 64 values kept BF16."""
    rows = kv_c.shape[0]
    blocks = rows // BLOCK_SIZE
    groups = kv_c[:, :V4_FP8_DIM].float().reshape(rows, V4_SCALES, V4_GROUP)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-4) / E4M3_MAX))
    values = (groups / torch.exp2(exp)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    cache = torch.zeros(blocks, V4_BLOCK_STRIDE, dtype=torch.uint8, device=kv_c.device)
    data = cache[:, : BLOCK_SIZE * V4_DATA_BYTES].view(blocks, BLOCK_SIZE, -1)
    data[..., :V4_FP8_DIM] = (
        values.to(torch.float8_e4m3fn).view(torch.uint8).view(blocks, BLOCK_SIZE, -1)
    )
    tail = kv_c[:, V4_FP8_DIM:].contiguous().view(torch.uint8)
    data[..., V4_FP8_DIM:] = tail.view(blocks, BLOCK_SIZE, -1)
    scales = cache[:, BLOCK_SIZE * V4_DATA_BYTES : BLOCK_SIZE * V4_ROW_BYTES]
    scales = scales.view(blocks, BLOCK_SIZE, V4_ROW_BYTES - V4_DATA_BYTES)
    scales[..., :V4_SCALES] = (
        (exp + 127).clamp(0, 255).to(torch.uint8).view(blocks, BLOCK_SIZE, V4_SCALES)
    )
    return cache


def v4_fields(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V4 pages' E4M3 values (rows x 7 x 64), scales (rows x 7) and BF16 tail
    (rows x 64), as fp32."""
    data = cache[:, : BLOCK_SIZE * V4_DATA_BYTES].reshape(-1, V4_DATA_BYTES)
    values = data[:, :V4_FP8_DIM].contiguous().view(torch.float8_e4m3fn).float()
    scales = cache[:, BLOCK_SIZE * V4_DATA_BYTES : BLOCK_SIZE * V4_ROW_BYTES]
    scales = scales.reshape(-1, V4_ROW_BYTES - V4_DATA_BYTES)[:, :V4_SCALES]
    tail = data[:, V4_FP8_DIM:].contiguous().view(torch.bfloat16).float()
    return (
        values.view(-1, V4_SCALES, V4_GROUP),
        torch.exp2(scales.float() - 127),
        tail,
    )


def v4_dequant(cache: torch.Tensor) -> torch.Tensor:
    values, scales, tail = v4_fields(cache)
    return torch.cat([(values * scales[..., None]).flatten(1), tail], dim=-1)


def v4_kernel_view(cache: torch.Tensor) -> torch.Tensor:
    """V4 pages as FlashMLA takes them (DeepSeek-V4's `kv_cache.unsqueeze(-2)`):
    (blocks, 64, 1, 584) with stride(0) the padded page."""
    return cache.as_strided(
        (cache.shape[0], BLOCK_SIZE, 1, V4_ROW_BYTES),
        (cache.stride(0), V4_ROW_BYTES, V4_ROW_BYTES, 1),
    )


def v4_fused_writer(kv_c: torch.Tensor, cache2d: torch.Tensor, slots: torch.Tensor):
    """DeepSeek-V4's CUDA writer on NVIDIA, KV side only: RoPE with cos 1 and
    sin 0 keeps GLM's last 64 values as they are; no query norm or RoPE."""
    op = torch.ops._C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert
    half = (KV_LORA_RANK - V4_FP8_DIM) // 2
    cos_sin = torch.cat([torch.ones(1, half), torch.zeros(1, half)], -1)
    cos_sin = cos_sin.to(kv_c.device)
    for start in range(0, kv_c.shape[0], 1 << 16):
        kv = kv_c[start : start + (1 << 16)]
        n = kv.shape[0]
        op(
            kv.new_zeros((n, 1, KV_LORA_RANK)),
            kv,
            cache2d,
            slots[start : start + n],
            torch.zeros(n, dtype=torch.int64, device=kv.device),
            cos_sin,
            1,
            1e-6,
            BLOCK_SIZE,
            apply_q_norm=False,
            apply_q_rope=False,
        )


def v4_triton_writer() -> Callable:
    """vLLM's Triton `quantize_and_insert_k_cache`, loaded from its file (the
    package's `__init__` would import the whole DeepSeek-V4 model)."""
    import vllm

    path = Path(vllm.__file__).parent / "models/deepseek_v4/common/ops/cache_utils.py"
    spec = importlib.util.spec_from_file_location("_bench_v4_cache_utils", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = module.quantize_and_insert_k_cache
    return lambda kv_c, cache2d, slots: fn(kv_c, cache2d, slots, block_size=BLOCK_SIZE)


V4_WRITERS: dict[str, Callable[[], Callable]] = {
    "vLLM _C.fused_deepseek_v4_qnorm_rope_kv_rope_quant_insert": lambda: (
        v4_fused_writer
    ),
    "vLLM Triton quantize_and_insert_k_cache": v4_triton_writer,
}


def v4_write(
    v: SimpleNamespace, kv_c: torch.Tensor, writer: str | None = None
) -> tuple[torch.Tensor, str]:
    """`kv_c` as V4 pages, by the first of vLLM's V4 writers that runs (else
    the reference writer); a writer that failed once is not tried again."""
    rows = kv_c.shape[0]
    names = [writer] if writer else [n for n in V4_WRITERS if n not in v.v4_failed]
    for name in names:
        cache = torch.zeros(
            rows // BLOCK_SIZE, V4_BLOCK_STRIDE, dtype=torch.uint8, device=kv_c.device
        )
        try:
            if name not in v.v4_loaded:
                v.v4_loaded[name] = V4_WRITERS[name]()
            v.v4_loaded[name](
                kv_c,
                cache[:, : BLOCK_SIZE * V4_ROW_BYTES],  # DeepSeek-V4's 2-D view
                torch.arange(rows, dtype=torch.int64, device=kv_c.device),
            )
            torch.cuda.synchronize()
        except Exception as exc:
            v.v4_failed[name] = error_text(exc)
            if writer:
                raise
            continue
        if writer or name in v.v4_loaded["checked"]:
            return cache, name
        # first use: rows this file's dequantizer cannot read are not timed
        n = min(rows, 64 * BLOCK_SIZE)
        got, ref = (
            v4_row_err(cache[: n // BLOCK_SIZE], kv_c[:n]),
            v4_row_err(v4_pack(kv_c[:n]), kv_c[:n]),
        )
        if got <= 2 * ref + 1e-3:
            v.v4_loaded["checked"].add(name)
            return cache, name
        v.v4_failed[name] = (
            f"rows unlike the reference: row error {got:.3g} > {ref:.3g}"
        )
    return v4_pack(kv_c), "reference (this benchmark)"


def v4_row_err(cache: torch.Tensor, kv_c: torch.Tensor) -> float:
    """The largest relative row error of V4 pages against the latent (NaN:
    inf)."""
    exact = kv_c.float()
    err = (v4_dequant(cache) - exact).norm(dim=-1) / exact.norm(dim=-1)
    return err.nan_to_num(nan=float("inf")).max().item()


class Case:
    """One decode batch: `tokens` one-token requests at `heads` query heads,
    each attending its 2051 selected tokens of a `ctx`-token context."""

    def __init__(
        self,
        v: SimpleNamespace,
        tokens: int,
        heads: int,
        ctx: int,
        latent: torch.Tensor,
        q: torch.Tensor,
        gen: torch.Generator,
        fp8_scale: float = 1.0,
    ):
        self.v, self.tokens, self.heads = v, tokens, heads
        blocks_per_req = -(-ctx // BLOCK_SIZE)
        span = blocks_per_req * BLOCK_SIZE
        self.kv_c = latent.to(torch.bfloat16)
        self.q = q.to(torch.bfloat16)
        self.fp8_scale = fp8_scale
        idx = torch.full((tokens, v.topk_width), -1, dtype=torch.int32, device=DEVICE)
        for t in range(tokens):  # one request's pick at a time: bounded memory
            pick = torch.randperm(ctx, generator=gen, device=DEVICE)[:NUM_SELECTED]
            idx[t, :NUM_SELECTED] = (pick + t * span).int()
        self.idx = idx
        self.workspace = torch.empty(
            FI_WORKSPACE_BYTES, dtype=torch.uint8, device=DEVICE
        )

    # FlashInfer (FLASHINFER_MLA_SPARSE_SM90) --------------------------------
    def fi_call(self, kv_dtype: torch.dtype, ckv: torch.Tensor, **scales: Any):
        """A planned FlashInfer call as `_SM90State` plans and runs it."""
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        tokens, heads = self.tokens, self.heads
        wrapper = BatchMLAPagedAttentionWrapper(self.workspace, backend="fa3")
        lens = torch.full((tokens,), NUM_SELECTED, dtype=torch.int32)
        kv_indptr = torch.zeros(tokens + 1, dtype=torch.int32)
        torch.cumsum(lens, dim=0, out=kv_indptr[1:])
        kv_indices = self.idx[:, :NUM_SELECTED].reshape(-1).contiguous()
        wrapper.plan(
            torch.arange(tokens + 1, dtype=torch.int32),
            kv_indptr,
            kv_indices,
            lens,
            heads,
            KV_LORA_RANK,  # head_dim_ckv
            0,  # head_dim_kpe: NoPE
            1,  # page_size: top-k slots are the page table
            False,  # causal: encoded by the indexer's selection
            SOFTMAX_SCALE,
            q_data_type=torch.bfloat16,
            kv_data_type=kv_dtype,
        )
        ckv = ckv.reshape(-1, 1, KV_LORA_RANK)
        kpe = ckv[..., KV_LORA_RANK:]  # zero-width, as vLLM slices it
        q_pe = self.q.new_empty((tokens, heads, 0))

        def run() -> torch.Tensor:
            return wrapper.run(self.q, q_pe, ckv, kpe, **scales)

        return run

    def fi_bf16(self):
        return self.fi_call(torch.bfloat16, self.kv_c)

    def fi_fp8(self):
        ckv = self.fp8_cache().view(torch.float8_e4m3fn)
        return self.fi_call(
            torch.float8_e4m3fn, ckv, ckv_scale=self.fp8_scale, kpe_scale=1.0
        )

    def fi_fp8_g128(self):
        values, scales = g128_from_ds_mla(self.ds_cache())
        return self.fi_call(
            torch.float8_e4m3fn,
            values,
            ckv_scale_arr=scales.reshape(-1, 1, KV_LORA_RANK // 128),
            kpe_scale=1.0,
        )

    def fp8_cache(self) -> torch.Tensor:
        """The per-tensor E4M3 rows, written once per case."""
        if not hasattr(self, "_fp8"):
            self._fp8 = write_rows(self.v, self.kv_c, "fp8", self.fp8_scale)
        return self._fp8

    # FlashMLA (FLASHMLA_SPARSE) ----------------------------------------------
    def ds_cache(self) -> torch.Tensor:
        if not hasattr(self, "_ds"):
            self._ds = write_rows(self.v, self.kv_c, "fp8_ds_mla", 1.0)
        return self._ds

    def flashmla_fp8(self):
        """The fp8 decode call of `FlashMLASparseImpl` (pure decode batch)."""
        v, tokens, heads = self.v, self.tokens, self.heads
        padded = v.fp8_padded_heads(heads)
        shape = (1, tokens) if heads < v.min_heads_bf16_prefill else (tokens, 1)
        qp = self.q.new_zeros((tokens, padded, QK_WIDTH))
        qp[:, :heads, :KV_LORA_RANK] = self.q
        qp = qp.view(*shape, padded, QK_WIDTH)
        k_cache = self.ds_cache().unsqueeze(-2)
        ind = self.idx.view(*shape, -1)
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

        return run

    def flashmla_bf16(self):
        """The BF16 call of `FlashMLASparseImpl._bf16_flash_mla_kernel`."""
        v, tokens, heads = self.v, self.tokens, self.heads
        padded = heads if v.bf16_small_head(tokens, heads) else v.round_up(heads, 64)
        qp = self.q.new_zeros((tokens, padded, KV_LORA_RANK))
        qp[:, :heads] = self.q
        kv = self.kv_c.view(-1, 1, KV_LORA_RANK)
        ind = self.idx.view(tokens, 1, -1)
        length = torch.full((tokens,), NUM_SELECTED, dtype=torch.int32, device=DEVICE)

        def run() -> torch.Tensor:
            out = v.fm.flash_mla_sparse_fwd(
                qp, kv, ind, SOFTMAX_SCALE, KV_LORA_RANK, topk_length=length
            )[0]
            return out[:, :heads]

        return run

    def v4_cache(self) -> torch.Tensor:
        if not hasattr(self, "_v4"):
            self._v4, self.v4_writer = v4_write(self.v, self.kv_c)
        return self._v4

    def flashmla_v4(self, with_length: bool = True):
        """FlashMLA's head-512 sparse decode as DeepSeek-V4's `_forward_decode`
        calls it: q (tokens, 1, 64, 512), heads padded to 64, `topk_length`."""
        v, tokens, heads = self.v, self.tokens, self.heads
        padded = v.fp8_padded_heads(heads)
        qp = self.q.new_zeros((tokens, padded, KV_LORA_RANK))
        qp[:, :heads] = self.q
        qp = qp.view(tokens, 1, padded, KV_LORA_RANK)
        k_cache = v4_kernel_view(self.v4_cache())
        ind = self.idx.view(tokens, 1, -1)
        length = torch.full((tokens,), NUM_SELECTED, dtype=torch.int32, device=DEVICE)
        meta, _ = v.fm.get_mla_metadata()

        def run() -> torch.Tensor:
            out, _ = v.fm.flash_mla_with_kvcache(
                q=qp,
                k_cache=k_cache,
                block_table=None,
                cache_seqlens=None,
                head_dim_v=KV_LORA_RANK,
                tile_scheduler_metadata=meta,
                softmax_scale=SOFTMAX_SCALE,
                is_fp8_kvcache=True,
                indices=ind,
                topk_length=length if with_length else None,
            )
            return out.reshape(tokens, padded, KV_LORA_RANK)[:, :heads]

        return run

    def flashmla_v4_full(self):
        return self.flashmla_v4(with_length=False)

    def calls(self, paths: tuple[str, ...]) -> dict[str, Callable | str]:
        """Each path's call, or the error that kept it from being built."""
        made: dict[str, Callable | str] = {}
        for name in paths:
            try:
                fn = getattr(self, name)()
                fn()
                torch.cuda.synchronize()
                made[name] = fn
            except Exception as exc:  # report it, time the others
                made[name] = error_text(exc)
        return made

    def stored(self, path: str) -> torch.Tensor:
        """The latent rows as `path`'s cache holds them, dequantized (fp32)."""
        if path in ("fi_bf16", "flashmla_bf16"):
            return self.kv_c.float()
        if path == "fi_fp8":
            rows = self.fp8_cache().view(torch.float8_e4m3fn).float()
            return rows.view(-1, KV_LORA_RANK) * self.fp8_scale
        if path.startswith("flashmla_v4"):
            return v4_dequant(self.v4_cache())
        values, scales = g128_from_ds_mla(self.ds_cache())
        groups = values.float().view(-1, KV_LORA_RANK // 128, 128)
        return (groups * scales.view(-1, KV_LORA_RANK // 128, 1)).view(-1, KV_LORA_RANK)

    def e4m3_units(self, path: str) -> torch.Tensor | None:
        """|latent / scale| of every value `path` stores as E4M3 (None: none)."""
        x = self.kv_c.float()
        if path == "fi_fp8":
            return (x / self.fp8_scale).abs().flatten()
        if path in ("flashmla_fp8", "fi_fp8_g128"):
            scales = g128_from_ds_mla(self.ds_cache())[1].view(-1, 4, 1)
            return (x.view(-1, 4, 128) / scales).abs().flatten()
        if path.startswith("flashmla_v4"):
            scales = v4_fields(self.v4_cache())[1][..., None]
            groups = x[:, :V4_FP8_DIM].reshape(-1, V4_SCALES, V4_GROUP)
            return (groups / scales).abs().flatten()
        return None

    def reference(self, keys: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 attention over `keys` (default: the BF16 latent): (tokens,
        heads, 512)."""
        kv = self.kv_c.float() if keys is None else keys
        keys = kv[self.idx[:, :NUM_SELECTED].long()]  # T,S,512
        logits = torch.bmm(self.q.float(), keys.transpose(1, 2)) * SOFTMAX_SCALE
        return torch.bmm(torch.softmax(logits, dim=-1), keys)


def time_group(fns: list[Callable], rounds: int, iters: int, warmup: int, flush):
    """Per round, the median microseconds of each fn; calls alternate."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        events: list[list] = [[] for _ in fns]
        for it in range(iters):
            order = list(range(len(fns)))
            if it % 2:
                order.reverse()
            for k in order:
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


def ratio(rounds: list[list[float]], timed: list[str], a: str, b: str) -> dict | None:
    """Path `a`'s time over path `b`'s: median and range over the rounds."""
    if a not in timed or b not in timed:
        return None
    ia, ib = timed.index(a), timed.index(b)
    return spread([r[ia] / r[ib] for r in rounds])


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def random_latent(rows: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, KV_LORA_RANK, generator=gen, device=DEVICE)


def decode(
    v: SimpleNamespace,
    args: argparse.Namespace,
    paths: tuple[str, ...] | None = None,
    title: str = "decode",
    shown: tuple[tuple[str, str], ...] = (
        ("flashmla_fp8", "fi_bf16"),
        ("flashmla_fp8", "fi_fp8"),
    ),
) -> list[dict]:
    paths = paths or tuple(args.paths.split(","))
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    results = []
    print(
        f"\n## {title}: kernel us (L2 cold), ctx {args.ctx}/request, "
        f"{args.rounds} rounds x {args.iters} calls"
    )
    head = " ".join(f"{p[:13]:>13}" for p in paths)
    cols = "  ".join(f"{SHORT.get(a, a)}/{SHORT.get(b, b)}" for a, b in shown)
    print(f"{'tp':>3} {'heads':>5} {'tokens':>6} {head}  {cols}")
    for tp in (int(t) for t in args.tp.split(",")):
        heads = NUM_HEADS // tp
        for tokens in (int(t) for t in args.tokens.split(",")):
            try:
                row = decode_row(v, args, paths, tp, heads, tokens, flush)
            except Exception as exc:  # e.g. out of memory: the next row
                row = {
                    "tp": tp,
                    "tokens": tokens,
                    "path": "all",
                    "error": error_text(exc),
                }
                print(f"{tp:>3} {heads:>5} {tokens:>6} failed: {row['error']}")
                results.append(row)
                torch.cuda.empty_cache()
                continue
            results.append(row)
            us = row["us"]
            cells = " ".join(
                f"{us[p]:>13.1f}" if p in us else f"{'error':>13}" for p in paths
            )
            shown_r = [row["ratios"].get(f"{a}/{b}") for a, b in shown]
            rs = "  ".join(
                f"{r['median'] if r else float('nan'):>{len(c)}.2f}"
                for r, c in zip(shown_r, cols.split("  "), strict=True)
            )
            print(f"{tp:>3} {heads:>5} {tokens:>6} {cells}  {rs}", flush=True)
    for row in results:
        for p, err in row.get("errors", {}).items():
            print(f"# tp{row['tp']} tokens {row['tokens']}: {p} failed: {err}")
    return results


def decode_row(v, args, paths, tp, heads, tokens, flush) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(tokens * 131 + tp)
    rows = tokens * -(-args.ctx // BLOCK_SIZE) * BLOCK_SIZE
    latent = random_latent(rows, gen)
    q = torch.randn(tokens, heads, KV_LORA_RANK, generator=gen, device=DEVICE)
    case = Case(v, tokens, heads, args.ctx, latent, q * 0.05, gen)
    del latent
    made = case.calls(paths)
    timed = [p for p in paths if callable(made[p])]
    rounds = time_group(
        [made[p] for p in timed], args.rounds, args.iters, args.warmup, flush
    )
    us = {p: statistics.median(r[i] for r in rounds) for i, p in enumerate(timed)}
    row = {
        "tp": tp,
        "heads": heads,
        "tokens": tokens,
        "us": us,
        "errors": {p: made[p] for p in paths if not callable(made[p])},
        "rounds_us": {p: [r[i] for r in rounds] for i, p in enumerate(timed)},
        "ratios": {
            f"{a}/{b}": ratio(rounds, timed, a, b)
            for a in paths
            for b in ("fi_bf16", "fi_fp8", "flashmla_fp8")
            if a != b and b in paths
        },
    }
    if hasattr(case, "v4_writer"):
        row["v4_writer"] = case.v4_writer
    del case, made
    torch.cuda.empty_cache()
    return row


LATENTS = {
    "in-range": {
        "sigma": 0.5,
        "outliers": 4,
        "outlier_gain": 8.0,
        "big_tokens": 0.002,
        "big_gain": 2.0,
    },
    # per-channel scale spread (lognormal sigma), outlier channels x gain,
    # share of tokens with a large norm x gain
    "moderate": {
        "sigma": 0.5,
        "outliers": 4,
        "outlier_gain": 16.0,
        "big_tokens": 0.002,
        "big_gain": 4.0,
    },
    "heavy": {
        "sigma": 0.5,
        "outliers": 4,
        "outlier_gain": 64.0,
        "big_tokens": 0.002,
        "big_gain": 16.0,
    },
}


def structured_latent(rows: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """RMS-normalized rows times a per-channel gain with outlier channels,
    a few rows scaled up (tokens of large norm)."""
    p = LATENTS[kind]
    x = random_latent(rows, gen)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))
    gain = torch.exp(
        torch.randn(KV_LORA_RANK, generator=gen, device=DEVICE) * p["sigma"]
    )
    out = torch.randperm(KV_LORA_RANK, generator=gen, device=DEVICE)[: p["outliers"]]
    gain[out] *= p["outlier_gain"]
    x = x * gain
    big = torch.rand(rows, generator=gen, device=DEVICE) < p["big_tokens"]
    x[big] *= p["big_gain"]
    return x


def rmsnorm_latent(
    rows: int,
    gain: float,
    gen: torch.Generator,
    outliers: int = 4,
    outlier_gain: float = 8.0,
    sigma: float = 0.5,
) -> torch.Tensor:
    """`kv_a_layernorm`'s output: rmsnorm(z) * gamma, gamma = `gain` times a
    per-channel lognormal spread, `outliers` channels `outlier_gain` larger;
    so |x_i| <= sqrt(512) * gamma_i."""
    z = random_latent(rows, gen)
    gamma = gain * torch.exp(
        torch.randn(KV_LORA_RANK, generator=gen, device=DEVICE) * sigma
    )
    out = torch.randperm(KV_LORA_RANK, generator=gen, device=DEVICE)[:outliers]
    gamma[out] *= outlier_gain
    return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma


ACCURACY_LAYOUTS = [
    ("fi_bf16", "bf16", None),
    ("fi_fp8", "fp8 per-tensor, scale 1.0", 1.0),
    ("fi_fp8", "fp8 per-tensor, calibrated", "amax"),
    ("fi_fp8_g128", "fp8 per-128 (FlashInfer)", None),
    ("flashmla_fp8", "fp8_ds_mla (FlashMLA)", None),
    ("flashmla_bf16", "bf16 (FlashMLA)", None),
]
V4_LAYOUT = ("flashmla_v4", "fp8 584 head512 (FlashMLA)", None)
GAIN_LAYOUTS = [
    ACCURACY_LAYOUTS[0],
    ACCURACY_LAYOUTS[1],
    ACCURACY_LAYOUTS[2],
    ACCURACY_LAYOUTS[4],
    V4_LAYOUT,
]


def accuracy(v: SimpleNamespace, args: argparse.Namespace) -> list[dict]:
    latents = {
        k: (lambda rows, gen, k=k: structured_latent(rows, k, gen)) for k in LATENTS
    }
    return accuracy_table(v, args, "accuracy", latents, ACCURACY_LAYOUTS)


def accuracy_table(
    v: SimpleNamespace,
    args: argparse.Namespace,
    title: str,
    latents: dict[str, Callable[[int, torch.Generator], torch.Tensor]],
    layouts: list[tuple[str, str, Any]],
) -> list[dict]:
    tokens, heads = args.acc_tokens, NUM_HEADS
    print(
        f"\n## {title}: |out - ref| / |ref| per (token, head), fp32 reference "
        f"from the BF16 latent; {tokens} tokens x {heads} heads x "
        f"{args.acc_seeds} seeds; synthetic latents; sat: |v/scale| > 448, "
        f"sub: < 2^-6 (E4M3 values)"
    )
    print(
        f"{'latent':>10} {'layout':>26} {'median':>9} {'p99':>9} {'max':>9} "
        f"{'nan':>4} {'row med':>9} {'row max':>9} {'shrunk':>9} {'sat':>9} "
        f"{'sub':>9}"
    )
    results = []
    for kind, make_latent in latents.items():
        errs: dict[str, list[torch.Tensor]] = {label: [] for _, label, _ in layouts}
        nans = dict.fromkeys(errs, 0)
        rows_err: dict[str, list[torch.Tensor]] = {label: [] for label in errs}
        clip = dict.fromkeys(errs, 0.0)
        sat: dict[str, list[float]] = {label: [] for label in errs}
        sub: dict[str, list[float]] = {label: [] for label in errs}
        failures: dict[str, str] = {}
        writers: dict[str, str] = {}
        amax = 0.0
        for seed in range(args.acc_seeds):
            gen = torch.Generator(device=DEVICE).manual_seed(1000 + seed)
            rows = tokens * -(-args.acc_ctx // BLOCK_SIZE) * BLOCK_SIZE
            latent = make_latent(rows, gen)
            amax = max(amax, latent.abs().max().item())
            # queries whose logits spread by ~3 nats
            spread_ = latent.pow(2).mean(0).sum().sqrt().item() * SOFTMAX_SCALE
            q = torch.randn(tokens, heads, KV_LORA_RANK, generator=gen, device=DEVICE)
            q = q * (3.0 / spread_)
            for path, label, scale in layouts:
                if label in failures:
                    continue
                try:
                    s = 1.0
                    if scale == "amax":
                        s = latent.to(torch.bfloat16).abs().max().item() / E4M3_MAX
                    elif scale is not None:
                        s = scale
                    case = Case(v, tokens, heads, args.acc_ctx, latent, q, gen, s)
                    ref = case.reference()
                    made = case.calls((path,))
                    if not callable(made[path]):
                        failures[label] = made[path]
                        continue
                    out = made[path]().float()
                    if hasattr(case, "v4_writer"):
                        writers[label] = case.v4_writer
                    nans[label] += int(torch.isnan(out).any(-1).sum().item())
                    stored = case.stored(path)
                    exact = case.kv_c.float()
                    row_err = (stored - exact).norm(dim=-1) / exact.norm(dim=-1)
                    clipped = (stored.abs() < exact.abs() * 0.75).float().mean()
                    rows_err[label].append(row_err)
                    clip[label] = max(clip[label], clipped.item())
                    del stored, exact
                    units = case.e4m3_units(path)
                    if units is not None:
                        sat[label].append((units > SATURATED).float().mean().item())
                        sub[label].append(
                            (units < E4M3_MIN_NORMAL).float().mean().item()
                        )
                    del units
                    err = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
                    errs[label].append(err.flatten())
                    del case
                except Exception as exc:  # this layout only
                    failures[label] = error_text(exc)
            torch.cuda.empty_cache()
        for _, label, _ in layouts:
            if label in failures:
                print(f"{kind:>10} {label:>26} failed: {failures[label]}")
                results.append(
                    {"latent": kind, "layout": label, "error": failures[label]}
                )
                continue
            e = torch.cat(errs[label]).nan_to_num(nan=float("inf"))
            r = torch.cat(rows_err[label])
            stats = {
                "median": e.median().item(),
                "p99": e.quantile(0.99).item(),
                "max": e.max().item(),
                "row_err_median": r.median().item(),
                "row_err_max": r.max().item(),
                "elements_shrunk": clip[label],
                "saturated": statistics.mean(sat[label]) if sat[label] else 0.0,
                "subnormal": statistics.mean(sub[label]) if sub[label] else 0.0,
            }
            print(
                f"{kind:>10} {label:>26} {stats['median']:>9.4f} "
                f"{stats['p99']:>9.4f} {stats['max']:>9.4f} {nans[label]:>4} "
                f"{stats['row_err_median']:>9.4f} {stats['row_err_max']:>9.4f} "
                f"{stats['elements_shrunk']:>9.2e} {stats['saturated']:>9.2e} "
                f"{stats['subnormal']:>9.2e}"
            )
            row = {
                "latent": kind,
                "layout": label,
                "amax": amax,
                "nan_rows": nans[label],
            }
            if label in writers:
                row["v4_writer"] = writers[label]
            results.append(row | stats)
        print(f"{kind:>10} latent amax {amax:.4g}")
    return results


def gain_sweep(v: SimpleNamespace, args: argparse.Namespace) -> list[dict]:
    gains = [float(g) for g in args.gains.split(",")]
    latents = {
        f"gain {g:g}": (lambda rows, gen, g=g: rmsnorm_latent(rows, g, gen))
        for g in gains
    }
    results = accuracy_table(v, args, "gain-sweep", latents, GAIN_LAYOUTS)
    print(
        "# where each layout loses accuracy: gains whose attention or row error "
        "median is over 1.25x its best gain's"
    )
    for _, label, _ in GAIN_LAYOUTS:
        rows = [r for r in results if r.get("layout") == label and "median" in r]
        if not rows:
            continue
        best = {k: min(r[k] for r in rows) for k in ("median", "row_err_median")}
        worse = []
        for r in rows:
            if any(r[k] > 1.25 * best[k] + 0.002 for k in best):
                why = "saturation" if r["saturated"] > 0 else "other"
                if r["subnormal"] > 0.01 and r["saturated"] == 0:
                    why = "subnormal"
                worse.append(
                    {k: r[k] for k in ("latent", "median", "row_err_median")}
                    | {"why": why}
                )
        results.append({"summary": label, "best": best, "worse": worse})
        text = ", ".join(
            f"{w['latent']} ({w['median']:.3f}, row {w['row_err_median']:.3f}, "
            f"{w['why']})"
            for w in worse
        )
        print(f"# {label}: best {best['median']:.4f}; {text or 'none'}")
    return results


# prefill (issue 43 item 4) ------------------------------------------------------
def prefill_step(ctx: int, budget: int) -> tuple[int, torch.Tensor, int]:
    """One scheduler step of `budget` prefill tokens of `ctx`-token prompts:
    (requests, the query positions of each, seq_len); a longer prompt's last
    chunk."""
    if ctx <= budget:
        return budget // ctx, torch.arange(ctx), ctx
    return 1, torch.arange(ctx - budget, ctx), ctx


def causal_topk(
    pos: torch.Tensor, seq_len: int, width: int, gen: torch.Generator
) -> torch.Tensor:
    """Per query position, NUM_SELECTED random positions at or before it (all
    of them below NUM_SELECTED), valid first, -1 padded to `width`."""
    out = torch.full((len(pos), width), -1, dtype=torch.int32, device=pos.device)
    k = min(NUM_SELECTED, seq_len)
    cols = torch.arange(seq_len, device=pos.device)
    for s in range(0, len(pos), 256):
        p = pos[s : s + 256]
        scores = torch.rand(len(p), seq_len, generator=gen, device=pos.device)
        scores.masked_fill_(cols[None] > p[:, None], -1.0)
        val, idx = scores.topk(k, dim=-1)
        out[s : s + len(p), :k] = torch.where(val >= 0, idx, -1).int()
    return out


def upconvert_op(v: SimpleNamespace) -> Callable:
    """`cp_gather_and_upconvert_fp8_kv_cache` as `_custom_ops` calls it (0.34.0:
    lengths implied by `workspace_starts` and the workspace's rows)."""
    op = v.cache_ops.cp_gather_and_upconvert_fp8_kv_cache
    names = [a.name for a in op.default._schema.arguments]
    if "seq_lens" in names:  # older kernels

        def call(src, dst, block_table, starts, lens, batch):
            op(src, dst, block_table, lens, starts, batch)

        return call
    return lambda src, dst, block_table, starts, lens, batch: op(
        src, dst, block_table, starts, batch, None
    )


def prefill(v: SimpleNamespace, args: argparse.Namespace) -> list[dict]:
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=DEVICE)
    budget = args.prefill_tokens
    print(
        f"\n## prefill: one step of {budget} prefill tokens, kernel us (L2 cold), "
        f"{args.prefill_rounds} rounds x {args.prefill_iters} calls; (a) mixed "
        f"fp8 decode kernel, q padded to 64 x 576 (+ the pad); a/{v.mixed_chunk}: "
        f"the series' mixed batch in chunks of that many, padded in a workspace; "
        f"(b) upconvert + flash_mla_sparse_fwd unpadded, topk_length"
    )
    print(
        f"{'heads':>5} {'ctx':>6} {'reqs':>4} {'tokens':>6} {'a kernel':>10} "
        f"{'a pad':>8} {'a chunked':>10} {'b kernel':>10} {'upconvert':>9} "
        f"{'b/a':>6} {'b/a chunked':>11} "
        f"{'[range]':>13} {'|a-b|/|a|':>9}"
    )
    results = []
    for heads in (int(h) for h in args.prefill_heads.split(",")):
        for ctx in (int(c) for c in args.prefill_ctx.split(",")):
            try:
                row = prefill_row(v, args, heads, ctx, budget, flush)
            except Exception as exc:
                row = {
                    "heads": heads,
                    "ctx": ctx,
                    "path": "prefill",
                    "error": error_text(exc),
                }
            torch.cuda.empty_cache()
            results.append(row)
            if "error" in row:
                print(f"{heads:>5} {ctx:>6} failed: {row['error']}")
                continue
            us, r, rc = row["us"], row["ratio_b_over_a"], row["ratio_b_over_a_chunked"]
            cells = " ".join(
                f"{us[k]:>{w}.0f}" if k in us else f"{'-':>{w}}"
                for k, w in (("a_kernel", 10), ("a_pad", 8), ("a_chunked", 10))
                + (("b_kernel", 10), ("b_upconvert", 9))
            )
            rng = f"[{r['min']:.2f}-{r['max']:.2f}]" if r else ""
            print(
                f"{heads:>5} {ctx:>6} {row['requests']:>4} {row['tokens']:>6} "
                f"{cells} {r['median'] if r else float('nan'):>6.2f} "
                f"{rc['median'] if rc else float('nan'):>11.2f} "
                f"{rng:>13} {row.get('a_vs_b_rel', float('nan')):>9.4f}",
                flush=True,
            )
            for p, err in row["errors"].items():
                print(f"# prefill heads {heads} ctx {ctx}: {p} failed: {err}")
    return results


def prefill_row(v, args, heads, ctx, budget, flush) -> dict:
    fm = v.fm
    gen = torch.Generator(device=DEVICE).manual_seed(ctx * 7 + heads)
    reqs, qpos, seq_len = prefill_step(ctx, budget)
    span = -(-seq_len // BLOCK_SIZE) * BLOCK_SIZE
    per_req = len(qpos)
    tokens = reqs * per_req
    pos = qpos.to(DEVICE).repeat(reqs)
    req = torch.arange(reqs, device=DEVICE).repeat_interleave(per_req)
    logical = causal_topk(pos, seq_len, v.topk_width, gen)
    valid = logical >= 0
    lengths = valid.sum(-1).int()
    kv_c = random_latent(reqs * span, gen).to(torch.bfloat16)
    ds = write_rows(v, kv_c, "fp8_ds_mla", 1.0)
    del kv_c
    q = torch.zeros(tokens, heads, QK_WIDTH, dtype=torch.bfloat16, device=DEVICE)
    q[..., :KV_LORA_RANK] = (
        torch.randn(tokens, heads, KV_LORA_RANK, generator=gen, device=DEVICE) * 0.05
    )
    fns: dict[str, Callable] = {}
    errors: dict[str, str] = {}

    # (a) _forward_fp8_kv_mixed_batch -> _fp8_flash_mla_kernel
    padded = v.fp8_padded_heads(heads)

    def pad() -> torch.Tensor:
        qp = q.new_zeros((1, tokens, padded, QK_WIDTH))
        qp[0, :, :heads] = q
        return qp

    try:
        qp = pad()
        glob = torch.where(valid, req[:, None].int() * span + logical, -1).view(
            1, tokens, -1
        )
        meta, _ = fm.get_mla_metadata()
        k_cache = ds.view(torch.uint8).unsqueeze(-2)
        dummy_block_table = torch.empty((1, 1), dtype=torch.int32, device=DEVICE)
        cache_lens = torch.full((1,), MAX_MODEL_LEN, dtype=torch.int32, device=DEVICE)

        def a_kernel() -> torch.Tensor:
            return fm.flash_mla_with_kvcache(
                q=qp,
                k_cache=k_cache,
                block_table=dummy_block_table,
                head_dim_v=KV_LORA_RANK,
                cache_seqlens=cache_lens,
                tile_scheduler_metadata=meta,
                is_fp8_kvcache=True,
                indices=glob,
                softmax_scale=SOFTMAX_SCALE,
            )[0]

        out_a = a_kernel()[0, :, :heads].float()
        fns["a_pad"], fns["a_kernel"] = pad, a_kernel
    except Exception as exc:
        errors["mixed_fp8"] = error_text(exc)
        out_a = None
    if v.mixed_chunk and out_a is not None:  # the series' `_fp8_mixed_batch_kernel`
        try:
            chunk = min(v.mixed_chunk, tokens)
            q_ws = q.new_zeros((chunk, padded, QK_WIDTH))
            out_ws = q.new_empty((chunk, padded, KV_LORA_RANK))
            out_c = q.new_empty((tokens, heads, KV_LORA_RANK))
            metas = [fm.get_mla_metadata()[0], fm.get_mla_metadata()[0]]

            def a_chunked() -> torch.Tensor:
                for start in range(0, tokens, chunk):
                    end = min(start + chunk, tokens)
                    q_c = q_ws[None, : end - start]
                    q_c[:, :, heads:].zero_()
                    q_c[:, :, :heads] = q[None, start:end]
                    out = fm.flash_mla_with_kvcache(
                        q=q_c,
                        k_cache=k_cache,
                        block_table=dummy_block_table,
                        head_dim_v=KV_LORA_RANK,
                        cache_seqlens=cache_lens,
                        tile_scheduler_metadata=metas[end - start < chunk],
                        is_fp8_kvcache=True,
                        indices=glob[:, start:end],
                        softmax_scale=SOFTMAX_SCALE,
                        out=out_ws[None, : end - start],
                    )[0]
                    out_c[start:end] = out[0, :, :heads]
                return out_c

            out = a_chunked().float()
            chunked_vs_a = ((out - out_a).norm() / out_a.norm()).item()
            fns["a_chunked"] = a_chunked
        except Exception as exc:
            errors["mixed_fp8_chunked"] = error_text(exc)

    # (b) _forward_fp8_kv_separate_prefill_decode's prefill chunks
    try:
        seq_lens = torch.full((reqs,), seq_len, dtype=torch.int32)
        chunks = v.split_prefill_chunks(
            seq_lens, MAX_MODEL_LEN * PREFILL_WORKSPACE_FACTOR
        )
        workspace = torch.empty(
            (max(seq_len * (c1 - c0) for c0, c1 in chunks), QK_WIDTH),
            dtype=torch.bfloat16,
            device=DEVICE,
        )
        block_table = torch.arange(
            reqs * span // BLOCK_SIZE, dtype=torch.int32, device=DEVICE
        ).view(reqs, -1)
        padded_out = torch.empty(
            (tokens, v.round_up(heads, 64), KV_LORA_RANK),
            dtype=torch.bfloat16,
            device=DEVICE,
        )
        upconvert = upconvert_op(v)
        steps = []
        for c0, c1 in chunks:
            t0, t1 = c0 * per_req, c1 * per_req
            local = torch.where(
                valid[t0:t1],
                (req[t0:t1, None].int() - c0) * seq_len + logical[t0:t1],
                -1,
            )
            small = v.bf16_small_head(t1 - t0, heads)
            chunk_q = q[t0:t1]
            if not small:  # vLLM pads into its workspace: done once here
                chunk_q = q.new_zeros((t1 - t0, v.round_up(heads, 64), QK_WIDTH))
                chunk_q[:, :heads] = q[t0:t1]
            steps.append(
                SimpleNamespace(
                    ws=workspace[: seq_len * (c1 - c0)],
                    block_table=block_table[c0:c1],
                    starts=torch.arange(c1 - c0, dtype=torch.int32, device=DEVICE)
                    * seq_len,
                    lens=seq_lens[c0:c1].to(DEVICE),
                    batch=c1 - c0,
                    q=chunk_q,
                    ind=local.view(t1 - t0, 1, -1),
                    length=lengths[t0:t1],
                    out=padded_out[t0:t1, :heads] if small else padded_out[t0:t1],
                    small=small,
                )
            )

        def b_upconvert(step=None) -> None:
            for s in [step] if step else steps:
                upconvert(ds, s.ws, s.block_table, s.starts, s.lens, s.batch)

        def b_kernel(step=None) -> None:
            for s in [step] if step else steps:
                fm.flash_mla_sparse_fwd(
                    s.q, s.ws.view(-1, 1, QK_WIDTH), s.ind, SOFTMAX_SCALE,
                    topk_length=s.length, out=s.out,
                )  # fmt: skip

        for s in steps:  # in vLLM's order, for the check against (a)
            b_upconvert(s)
            b_kernel(s)
        torch.cuda.synchronize()
        out_b = padded_out[:, :heads].float()
        fns["b_upconvert"], fns["b_kernel"] = b_upconvert, b_kernel
    except Exception as exc:
        errors["small_head_bf16"] = error_text(exc)
        out_b, steps = None, []

    timed = list(fns)
    rounds = []
    if timed:
        rounds = time_group(
            [fns[k] for k in timed],
            args.prefill_rounds,
            args.prefill_iters,
            args.prefill_warmup,
            flush,
        )
    us = {k: statistics.median(r[i] for r in rounds) for i, k in enumerate(timed)}
    col = {k: i for i, k in enumerate(timed)}
    a_round = b_round = None
    if "a_kernel" in col:
        a_round = [r[col["a_kernel"]] + r[col["a_pad"]] for r in rounds]
    if "b_kernel" in col:
        b_round = [r[col["b_kernel"]] + r[col["b_upconvert"]] for r in rounds]
    c_round = [r[col["a_chunked"]] for r in rounds] if "a_chunked" in col else None
    row = {
        "heads": heads,
        "ctx": ctx,
        "requests": reqs,
        "tokens": tokens,
        "query_positions": [int(qpos[0]), int(qpos[-1])],
        "seq_len": seq_len,
        "mean_selected": lengths.float().mean().item(),
        "padded_heads_a": padded,
        "chunks": len(steps),
        "small_head_b": all(s.small for s in steps) if steps else None,
        "us": us,
        "a_us": statistics.median(a_round) if a_round else None,
        "b_us": statistics.median(b_round) if b_round else None,
        "ratio_b_over_a": (
            spread([b / a for a, b in zip(a_round, b_round, strict=True)])
            if a_round and b_round
            else None
        ),
        "ratio_b_over_a_kernel": ratio(rounds, timed, "b_kernel", "a_kernel"),
        "mixed_chunk": v.mixed_chunk,
        "ratio_b_over_a_chunked": (
            spread([b / c for c, b in zip(c_round, b_round, strict=True)])
            if c_round and b_round
            else None
        ),
        "rounds_us": {k: [r[i] for r in rounds] for i, k in enumerate(timed)},
        "errors": errors,
    }
    if "a_chunked" in fns:
        row["a_chunked_vs_a_rel"] = chunked_vs_a
    if out_a is not None and out_b is not None:
        row["a_vs_b_rel"] = ((out_a - out_b).norm() / out_a.norm()).item()
        row["nan_b"] = bool(torch.isnan(out_b).any().item())
    return row


# head512 (issue 46) -------------------------------------------------------------
def v4_writer_check(v: SimpleNamespace) -> dict:
    """Each vLLM V4 writer's pages against the reference writer's, on 64 pages
    of the `heavy` latent."""
    gen = torch.Generator(device=DEVICE).manual_seed(46)
    kv_c = structured_latent(64 * BLOCK_SIZE, "heavy", gen).to(torch.bfloat16)
    ref = v4_pack(kv_c)
    used = BLOCK_SIZE * V4_ROW_BYTES  # bytes of a page the writers write
    report: dict[str, Any] = {
        "path": "v4_writers",
        "reference_row_err_max": (
            (v4_dequant(ref) - kv_c.float()).norm(dim=-1) / kv_c.float().norm(dim=-1)
        )
        .max()
        .item(),
    }
    for name in V4_WRITERS:
        started = time.time()
        try:
            got, _ = v4_write(v, kv_c, writer=name)
            report[name] = {
                "bytes_differing": int((got[:, :used] != ref[:, :used]).sum().item()),
                "bytes": int(ref[:, :used].numel()),
                "dequant_max_abs_diff": (v4_dequant(got) - v4_dequant(ref))
                .abs()
                .max()
                .item(),
                "seconds": round(time.time() - started, 1),
            }
        except Exception as exc:
            report[name] = {"error": error_text(exc)}
    return report


def head512(v: SimpleNamespace, args: argparse.Namespace) -> list[dict]:
    print(
        f"\n## head512: FlashMLA's SM90 head-512 decode over 584-byte rows "
        f"({V4_LIMITS})"
    )
    results: list[dict] = []
    check = v4_writer_check(v)
    results.append(check)
    for name in V4_WRITERS:
        print(f"# writer {name}: {check[name]}")
    # probe: can the kernel run GLM's shape, and does it read the rows right?
    gen = torch.Generator(device=DEVICE).manual_seed(4646)
    ctx, tokens, heads = 4096, 4, NUM_HEADS // 8
    latent = structured_latent(tokens * ctx, "moderate", gen)
    q = torch.randn(tokens, heads, KV_LORA_RANK, generator=gen, device=DEVICE) * 0.05
    case = Case(v, tokens, heads, ctx, latent, q, gen)
    made = case.calls(("flashmla_v4", "flashmla_v4_full"))
    probe: dict[str, Any] = {
        "path": "flashmla_v4",
        "heads": heads,
        "limits": V4_LIMITS,
    }
    if not callable(made["flashmla_v4"]):
        probe["error"] = made["flashmla_v4"]
        probe["writer_errors"] = dict(v.v4_failed)
        print(f"# flashmla_v4 cannot run GLM's shape: {probe['error']}")
        return [*results, probe]
    out = made["flashmla_v4"]().float()
    ref_rows = case.reference(case.stored("flashmla_v4"))
    ref_bf16 = case.reference()
    probe |= {
        "writer": case.v4_writer,
        "rel_err_vs_dequantized_ref": (
            (out - ref_rows).norm() / ref_rows.norm()
        ).item(),
        "rel_err_vs_bf16_ref": ((out - ref_bf16).norm() / ref_bf16.norm()).item(),
    }
    if callable(made["flashmla_v4_full"]):
        full = made["flashmla_v4_full"]().float()
        probe["full_vs_topk_length_rel"] = ((full - out).norm() / out.norm()).item()
    print(f"# probe: { {k: x for k, x in probe.items() if k != 'limits'} }")
    results.append(probe)
    del case, made, latent
    torch.cuda.empty_cache()
    results += decode(
        v,
        args,
        HEAD512_PATHS,
        "head512 decode",
        (
            ("flashmla_v4", "flashmla_fp8"),
            ("flashmla_v4", "fi_fp8"),
            ("flashmla_v4", "fi_bf16"),
        ),
    )
    latents = {
        k: (lambda rows, gen, k=k: structured_latent(rows, k, gen)) for k in LATENTS
    }
    results += accuracy_table(
        v, args, "head512 accuracy", latents, [ACCURACY_LAYOUTS[4], V4_LAYOUT]
    )
    return results


PARTS: dict[str, Callable[[SimpleNamespace, argparse.Namespace], list[dict]]] = {
    "decode": decode,
    "accuracy": accuracy,
    "prefill": prefill,
    "gain-sweep": gain_sweep,
    "head512": head512,
}
QUICK = {  # --quick: what it changes where the flag was left at its default
    "tokens": "1,4,16,64,256",
    "rounds": 3,
    "iters": 20,
    "warmup": 3,
    "acc_seeds": 1,
    "prefill_rounds": 3,
    "prefill_iters": 3,
    "gains": "0.01,0.1,0.3,1,3,10,30",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--tp", default="1,8", help="tensor-parallel sizes")
    parser.add_argument("--ctx", type=int, default=32768, help="context per request")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--acc-tokens", type=int, default=32)
    parser.add_argument("--acc-ctx", type=int, default=8192)
    parser.add_argument("--acc-seeds", type=int, default=2)
    parser.add_argument(
        "--parts", default="decode,accuracy", help=f"of {','.join(PARTS)}, or all"
    )
    parser.add_argument("--paths", default=",".join(PATHS), help="decode paths")
    parser.add_argument("--prefill-ctx", default="2048,8192,32768")
    parser.add_argument("--prefill-heads", default="8,16")
    parser.add_argument(
        "--prefill-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS,
        help="prefill tokens per step (max_num_batched_tokens)",
    )  # fmt: skip
    parser.add_argument("--prefill-rounds", type=int, default=5)
    parser.add_argument("--prefill-iters", type=int, default=6)
    parser.add_argument("--prefill-warmup", type=int, default=2)
    parser.add_argument("--gains", default="0.01,0.03,0.1,0.3,1,3,10,20,30")
    parser.add_argument(
        "--quick", action="store_true", help="fewer rows, rounds and seeds"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    args.parts = list(PARTS) if args.parts == "all" else args.parts.split(",")
    unknown = set(args.parts) - PARTS.keys()
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    v = load_vllm()
    try:
        import flashinfer

        fi_version = flashinfer.__version__
    except Exception as exc:
        fi_version = f"not importable: {type(exc).__name__}: {exc}"
    print(
        f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"flashinfer {fi_version}, top-k {NUM_SELECTED} padded to {v.topk_width}, "
        f"vllm {v.vllm_dir}"
    )
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "flashinfer": fi_version,
        "vllm": v.vllm_dir,
        "topk_width": v.topk_width,
        "args": vars(args) | {"json": str(args.json)},
        "row_bytes": ROW_BYTES,
        "paths": WHAT,
        "seconds": {},
    }
    for part in args.parts:
        started = time.time()
        try:
            report[part] = PARTS[part](v, args)
        except Exception as exc:  # the lease is short: the other parts go on
            report[part] = [{"path": part, "error": error_text(exc)}]
            print(f"# part {part} failed: {report[part][0]['error']}")
            torch.cuda.empty_cache()
        report["seconds"][part] = round(time.time() - started, 1)
        print(f"# {part}: {report['seconds'][part]} s", flush=True)
        if args.json:  # after every part: a run cut short keeps what it did
            args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
