# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The meta-device reports on the real vLLM of each base, pristine and
patched, all of one tree from one process (`--batch`: vLLM imported once).

`patchset coverage` reports the layer counts that the 001 description
claims: online quantization reaches the BF16 attention projections on the
patched tree only, and never the MTP layer 45.

`patchset capacity` plans GLM-5.3-Flash's KV cache with vLLM's own specs
and planner: on the patched tree `--kv-cache-dtype fp8` gives the 656-byte
fp8_ds_mla rows on SM90 and at least +50% tokens at the same budget; on the
pristine install it stays per-tensor fp8 (512-byte rows)."""

import json
from functools import cache

import pytest
from projectkit import declared_versions, report_batch

VERSIONS = declared_versions()

LAYERS = "([0-9]|[1-3][0-9]|4[0-4])"
MLA_LAYERS = "(3|7|11|15|19|23|27|31|35|39|43)"
SHARED = "mlp[.]shared_experts[.](gate_proj|up_proj|gate_up_proj|down_proj)"
ATTENTION = (
    "self_attn[.](in_proj_qkvbfg_a|o_proj|fused_qkv_a_proj|q_b_proj|indexer[.]wq_b)"
)
MLA = "self_attn[.](o_proj|fused_qkv_a_proj|q_b_proj|indexer[.]wq_b)"
# The description's regexes; the two block-FP8 ones drop the shared experts.
ALL_196 = f"re:.*[.]layers[.]{LAYERS}[.]({ATTENTION}|{SHARED})"
NON_KDA_128 = f"re:.*[.]layers[.]({MLA_LAYERS}[.]{MLA}|{LAYERS}[.]{SHARED})"
ATTENTION_112 = f"re:.*[.]layers[.]{LAYERS}[.]({ATTENTION})"
MLA_44 = f"re:.*[.]layers[.]({MLA_LAYERS}[.]{MLA})"

NVFP4 = ("--checkpoint", "nvfp4", "--quantization", "modelopt_fp4")
BLOCK_FP8 = ("--checkpoint", "block-fp8", "--quantization", "fp8")


def targets(regex: str) -> str:
    return json.dumps({"targets": {regex: "mxfp8"}})


ONLINE_CASES = [
    (NVFP4, ALL_196, False, 196),
    (NVFP4, NON_KDA_128, False, 128),
    (BLOCK_FP8, ATTENTION_112, False, 112),
    (BLOCK_FP8, MLA_44, False, 44),
    (NVFP4, ALL_196, True, 84),
]
ONLINE_IDS = [
    "nvfp4-all-196",
    "nvfp4-non-kda-128",
    "block-fp8-attention-112",
    "block-fp8-mla-44",
    "pristine-nvfp4-all-196-gives-84",
]
NO_ONLINE_CASES = [
    (("--checkpoint", "bf16", "--quantization", "mxfp8"), None),
    (("--checkpoint", "bf16", "--quantization-config", targets(ALL_196)), 0),
]


def online_arguments(checkpoint: tuple[str, ...], regex: str) -> tuple[str, ...]:
    return (*checkpoint, "--quantization-config", targets(regex))


CAPACITY = ("capacity",)
"""The batch case of the capacity report (both columns, default budget)."""


def tree_cases(pristine: bool) -> list[tuple[str, ...]]:
    """Every argument list the tests below ask of one tree: the coverage
    cases, then the capacity report."""
    cases = [online_arguments(c, r) for c, r, p, _ in ONLINE_CASES if p == pristine]
    cases += [] if pristine else [args for args, _ in NO_ONLINE_CASES]
    return [*cases, CAPACITY]


@cache
def tree_reports(version: str, pristine: bool) -> dict[tuple[str, ...], dict]:
    """The report of each case of one tree, from one process."""
    cases = tree_cases(pristine)
    reports = report_batch("coverage", version, pristine, [list(c) for c in cases])
    return dict(zip(cases, reports, strict=True))


def coverage(*args: str, version: str, pristine: bool = False) -> dict:
    return tree_reports(version, pristine)[args]


def capacity(version: str, pristine: bool) -> dict:
    return tree_reports(version, pristine)[CAPACITY]


def tree_group(version: str, pristine: bool) -> pytest.MarkDecorator:
    """Run one tree's cases on one xdist worker, so its batch runs once."""
    return pytest.mark.xdist_group(f"reports-{version}-{pristine}")


@pytest.mark.parametrize(
    "version, checkpoint, regex, pristine, expected",
    [
        pytest.param(v, *case, id=f"{v}-{name}", marks=tree_group(v, case[2]))
        for v in VERSIONS
        for case, name in zip(ONLINE_CASES, ONLINE_IDS, strict=True)
    ],
)
def test_online_quantization_coverage(version, checkpoint, regex, pristine, expected):
    args = online_arguments(checkpoint, regex)
    report = coverage(*args, version=version, pristine=pristine)
    assert report["tree"] == f"{version}-{'pristine' if pristine else 'patched'}"
    assert report["online_quantized"] == expected
    assert report["mtp_online_quantized"] == 0


@pytest.mark.parametrize(
    "version, args, total",
    [
        pytest.param(v, *case, id=f"{v}-{name}", marks=tree_group(v, False))
        for v in VERSIONS
        for case, name in zip(
            NO_ONLINE_CASES,
            ["mxfp8-shorthand", "bf16-targets-without-quantization-online"],
            strict=True,
        )
    ],
)
def test_no_attention_projection_without_an_online_request(version, args, total):
    """The shorthand quantizes MLPs only; a BF16 checkpoint without
    `--quantization online` ignores the targets, as on the pristine base."""
    report = coverage(*args, version=version)
    assert report["tree"] == f"{version}-patched"
    for part in ("target", "mtp"):
        online = report["by_projection"][part]["online"]
        assert [name for name in online if name.startswith("self_attn")] == []
    if total is not None:
        assert report["online_quantized"] == total


MLA = "MLA rows (target)"
MTP = "MLA rows (MTP layer 45)"


def cache_row(column: dict, kind: str) -> dict:
    (row,) = (r for r in column["caches"] if r["kind"] == kind)
    return row


CAPACITY_CASES = {
    "patched-fp8-is-fp8_ds_mla-656B": (
        False,
        "fp8_ds_mla",
        "FLASHMLA_SPARSE",
        656,
        1.50,
        1024 / 656,
    ),
    "pristine-fp8-is-per-tensor-512B": (
        True,
        "fp8",
        "FLASHINFER_MLA_SPARSE_SM90",
        512,
        1.90,
        2.0,
    ),
}


@pytest.mark.parametrize(
    "version, pristine, fp8_dtype, fp8_backend, fp8_row_bytes, min_ratio, max_ratio",
    [
        pytest.param(v, *case, id=f"{v}-{name}", marks=tree_group(v, case[0]))
        for v in VERSIONS
        for name, case in CAPACITY_CASES.items()
    ],
)
def test_capacity_bf16_vs_fp8(
    version, pristine, fp8_dtype, fp8_backend, fp8_row_bytes, min_ratio, max_ratio
):
    report = capacity(version, pristine)
    assert report["tree"] == f"{version}-{'pristine' if pristine else 'patched'}"
    assert set(report["columns"]) == {"auto", "fp8"}
    auto, fp8 = report["columns"]["auto"], report["columns"]["fp8"]
    # The engine config keeps the flag; each MLA layer's selection decides.
    assert fp8["engine_cache_dtype"] == "fp8"
    for kind, layers in ((MLA, 11), (MTP, 1)):
        assert cache_row(auto, kind)["layers"] == layers
        assert cache_row(auto, kind)["bytes_per_token"] == 1024
        assert cache_row(fp8, kind)["bytes_per_token"] == fp8_row_bytes
        assert cache_row(fp8, kind)["cache_dtype"] == fp8_dtype
        assert cache_row(fp8, kind)["backend"] == fp8_backend
    # The caches the MLA dtype does not touch.
    index = "indexer K (KPool-compressed)"
    assert cache_row(auto, index)["layers"] == 12
    assert cache_row(auto, index)["bytes_per_token"] == 33
    assert cache_row(fp8, index)["bytes_per_token"] == 33
    tail = "KPool tail ring"
    assert cache_row(auto, tail)["layers"] == 12
    assert (
        cache_row(fp8, tail)["real_page_bytes"]
        == cache_row(auto, tail)["real_page_bytes"]
    )
    kda = "KDA recurrent + conv state"
    assert cache_row(auto, kda)["layers"] == 34
    assert (
        cache_row(auto, kda)["real_page_bytes"]
        == cache_row(fp8, kda)["real_page_bytes"]
    )
    assert report["mla_row_ratio"] == pytest.approx(1024 / fp8_row_bytes, abs=1e-4)
    ratio = report["ratio"]["block_tokens"]
    assert ratio == pytest.approx(fp8["block_tokens"] / auto["block_tokens"], 1e-3)
    assert min_ratio <= ratio <= max_ratio
    assert report["ratio"]["vllm_tokens"] > 1


@pytest.mark.parametrize(
    "version, pristine",
    [
        pytest.param(
            v, p, id=f"{v}-{'pristine' if p else 'patched'}", marks=tree_group(v, p)
        )
        for v in VERSIONS
        for p in (False, True)
    ],
)
def test_capacity_takes_flashmla_sparse_workspace_from_the_budget(version, pristine):
    auto, fp8 = capacity(version, pristine)["columns"].values()
    assert auto["workspace_bytes"] == 0, "FlashInfer's BF16 path reserves none"
    assert auto["vllm_tokens_less_workspace"] == auto["vllm_tokens"]
    if pristine:  # fp8 stays on FlashInfer's per-tensor rows
        assert fp8["workspace_bytes"] == 0
        return
    # FlashMLA sparse's mixed batch (8 heads at TP8) reserves its query and
    # one chunk's padded query and output at load, not the prefill path's.
    assert 0 < fp8["workspace_bytes"] < 0.3 * 2**30, "at 8192 tokens, TP8"
    assert fp8["vllm_tokens_less_workspace"] < fp8["vllm_tokens"]
