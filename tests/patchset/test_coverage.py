# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset coverage` reports the layer counts that the 001 description
claims: online quantization reaches the BF16 attention projections on the
patched tree only, and never the MTP layer 45."""

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


def tree_cases(pristine: bool) -> list[tuple[str, ...]]:
    """Every argument list the tests below ask of one tree."""
    cases = [online_arguments(c, r) for c, r, p, _ in ONLINE_CASES if p == pristine]
    return cases + ([] if pristine else [args for args, _ in NO_ONLINE_CASES])


@cache
def tree_reports(version: str, pristine: bool) -> dict[tuple[str, ...], dict]:
    """The coverage report of each case of one tree, from one process."""
    cases = tree_cases(pristine)
    reports = report_batch("coverage", version, pristine, [list(c) for c in cases])
    return dict(zip(cases, reports, strict=True))


def coverage(*args: str, version: str, pristine: bool = False) -> dict:
    return tree_reports(version, pristine)[args]


def tree_group(version: str, pristine: bool) -> pytest.MarkDecorator:
    """Run one tree's cases on one xdist worker, so its batch runs once."""
    return pytest.mark.xdist_group(f"coverage-{version}-{pristine}")


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
