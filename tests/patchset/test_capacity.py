# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset capacity` plans GLM-5.3-Flash's KV cache with vLLM's own specs
and planner: on the patched tree `--kv-cache-dtype fp8` gives the 656-byte
fp8_ds_mla rows on SM90 and at least +50% tokens at the same budget; on the
pristine install it stays per-tensor fp8 (512-byte rows)."""

from functools import cache

import pytest
from projectkit import declared_versions, report_batch

MLA = "MLA rows (target)"
MTP = "MLA rows (MTP layer 45)"


@cache
def capacity(version: str, pristine: bool) -> dict:
    """The JSON report of one tree (each run builds the model twice)."""
    (report,) = report_batch("capacity", version, pristine, [[]])
    return report


def cache_row(column: dict, kind: str) -> dict:
    (row,) = (r for r in column["caches"] if r["kind"] == kind)
    return row


@pytest.mark.parametrize("version", declared_versions())
@pytest.mark.parametrize(
    "pristine, fp8_dtype, fp8_backend, fp8_row_bytes, min_ratio, max_ratio",
    [
        (False, "fp8_ds_mla", "FLASHMLA_SPARSE", 656, 1.50, 1024 / 656),
        (True, "fp8", "FLASHINFER_MLA_SPARSE_SM90", 512, 1.90, 2.0),
    ],
    ids=["patched-fp8-is-fp8_ds_mla-656B", "pristine-fp8-is-per-tensor-512B"],
)
def test_capacity_bf16_vs_fp8(
    version, pristine, fp8_dtype, fp8_backend, fp8_row_bytes, min_ratio, max_ratio
):
    report = capacity(version, pristine)
    assert report["tree"] == f"{version}-{'pristine' if pristine else 'patched'}"
    assert set(report["columns"]) == {"auto", "fp8"}
    auto, fp8 = report["columns"]["auto"], report["columns"]["fp8"]
    assert fp8["engine_cache_dtype"] == fp8_dtype
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
