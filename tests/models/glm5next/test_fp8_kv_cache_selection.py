# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""No regression in KV-cache backend and dtype selection: the patched tree
selects, case by case, what the pristine tree of the same base selects in the
same run, except where `fp8_kv_cache_expectations.json` lists the patched
selection the series intends.

Both trees resolve every case of `fp8_kv_cache_matrix.CASES` (SM90 and
SM100; GLM-5.3-Flash's 512-wide latent and DeepSeek-V3.2's 576; every
`--kv-cache-dtype`; explicit backends; no drafter, MTP, EAGLE3, a draft
model or a DSpark drafter; tensor and decode-context parallelism) in one
worker process each, on a mocked CUDA device. `scripts/patchset test` names
the trees: `GLM5NEXT_VERIFY_PRISTINE_ROOT` and `GLM5NEXT_VERIFY_PATCHED_ROOT`
are directories holding the base's pristine and patched `vllm` package.

A case cannot pass because both trees fail the same way on this host: every
error must be one vLLM raises on purpose (a `ValueError` or a config
validation error from vLLM's own code), and every SM100 case must resolve a
backend unless the expectations file says why it cannot.
"""

import fnmatch
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fp8_kv_cache_matrix as matrix
import glm5next_verify as verify
import pytest

EXPECTATIONS = Path(__file__).with_name("fp8_kv_cache_expectations.json")
TREES = {"pristine": verify.PRISTINE_ROOT_VAR, "patched": verify.PATCHED_ROOT_VAR}

NOPE_DIM, ROPE_DIM = 512, 64
ROW_BYTES = NOPE_DIM + NOPE_DIM // 128 * 4 + ROPE_DIM * 2
"""FlashMLA's fp8_ds_mla row: 512 e4m3, a float32 scale per 128, 64 bf16."""


def _run_worker(tree: str, tmp_dir: Path, case_ids: list[str]) -> dict[str, Any]:
    """Resolve `case_ids` in a fresh interpreter that imports `tree`'s vLLM
    (the mocked CUDA platform must not leak into other tests)."""
    var = TREES[tree]
    root = verify.tree_root(var)
    if root is None:
        pytest.fail(f"{var} is not set: run this suite with `scripts/patchset test`")
    assert root is not None
    env = verify.tree_env(root, os.environ.get(var + verify.CACHE_VAR_SUFFIX))
    # Triton then keeps its GPU driver although none is active, as on a GPU
    # host: vLLM 0.33.0 imports Model Runner V2's drafter code only with it.
    env["CUDA_VISIBLE_DEVICES"] = ""
    if not verify.has_libcuda():
        stub = verify.build_libcuda_stub(tmp_dir)
        if stub is None:
            pytest.fail("needs libcuda.so.1 or gcc to build a driver stub")
        env[verify.LIBCUDA_STUB_VAR] = str(stub)
    request = tmp_dir / "request.json"
    model_dirs = matrix.write_model_dirs(tmp_dir / "models")
    request.write_text(json.dumps({"model_dirs": model_dirs, "case_ids": case_ids}))
    proc = subprocess.run(
        [sys.executable, matrix.__file__, str(request)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"{tree} worker:\n{proc.stderr[-5000:]}"
    results = json.loads(lines[-1].removeprefix("RESULTS "))
    results["root"] = str(root)
    return results


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both trees' results for every case, the two workers side by side."""
    case_ids = list(matrix.CASES)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            tree: pool.submit(
                _run_worker, tree, tmp_path_factory.mktemp(tree), case_ids
            )
            for tree in TREES
        }
        return {tree: future.result() for tree, future in futures.items()}


@pytest.fixture(scope="module")
def expectations() -> dict[str, Any]:
    return json.loads(EXPECTATIONS.read_text())


def _intended(expectations: dict[str, Any], version: str) -> dict[str, Any]:
    """The patched selections the series intends on `version`, by case id."""
    return expectations["intended"].get(version, {})


def test_trees_are_the_pristine_and_the_patched_vllm(
    trees: dict[str, dict[str, Any]],
) -> None:
    for tree, results in trees.items():
        assert Path(results["vllm_file"]).is_relative_to(results["root"]), tree
    assert trees["pristine"]["root"] != trees["patched"]["root"]
    assert trees["pristine"]["vllm_version"] == trees["patched"]["vllm_version"]


@pytest.mark.parametrize("group", matrix.GROUPS)
def test_selections_match_the_pristine_tree_except_the_intended(
    trees: dict[str, dict[str, Any]], expectations: dict[str, Any], group: str
) -> None:
    """Each case of `group`: the patched tree's selections are the pristine
    tree's, or the intended ones the expectations file lists; a listed case
    must really change (else the list is stale)."""
    pristine, patched = trees["pristine"]["cases"], trees["patched"]["cases"]
    intended = _intended(expectations, trees["pristine"]["vllm_version"])
    wrong = []
    for case_id, case in matrix.CASES.items():
        if case["group"] != group:
            continue
        before, after = pristine[case_id]["selection"], patched[case_id]["selection"]
        expected = intended.get(case_id, before)
        if after != expected:
            wrong.append(f"{case_id}: pristine {before}, patched {after}")
        elif case_id in intended and before == expected:
            wrong.append(f"{case_id}: listed as intended but unchanged: {before}")
    assert not wrong, "\n".join(wrong)


def test_no_configuration_that_starts_pristine_fails_patched(
    trees: dict[str, dict[str, Any]],
) -> None:
    """An intended change may let a configuration start, never stop one."""
    pristine, patched = trees["pristine"]["cases"], trees["patched"]["cases"]
    stopped = [
        f"{case_id} {layer}: {before} -> {patched[case_id]['selection'][layer]}"
        for case_id in matrix.CASES
        for layer, before in pristine[case_id]["selection"].items()
        if not before.startswith("error")
        and patched[case_id]["selection"][layer].startswith("error")
    ]
    assert not stopped, "\n".join(stopped)


def test_intended_cases_exist(
    trees: dict[str, dict[str, Any]], expectations: dict[str, Any]
) -> None:
    intended = _intended(expectations, trees["pristine"]["vllm_version"])
    assert intended, "no intended change listed for this base"
    assert not set(intended) - set(matrix.CASES)


@pytest.mark.parametrize("tree", list(TREES))
def test_no_case_fails_for_a_host_reason(
    trees: dict[str, dict[str, Any]], tree: str
) -> None:
    """Every error is one vLLM raises on purpose about the configuration, not
    one of this host (no driver, no GPU memory, a missing module)."""
    host = [
        f"{case_id}: {e['type']} at {e['where']}: {e['message'][:300]}"
        for case_id, result in trees[tree]["cases"].items()
        for e in result.get("errors", [])
        if not e["deliberate"]
    ]
    assert not host, "\n".join(host)


def test_sm100_cases_resolve_a_backend(
    trees: dict[str, dict[str, Any]], expectations: dict[str, Any]
) -> None:
    """On the mocked SM100 device every layer resolves a real backend in
    both trees, except where the expectations file lists why it cannot: each
    error of an SM100 case must say what a matching entry says."""
    unresolvable: list[dict[str, str]] = expectations["sm100_unresolvable"]
    wrong = []
    for tree, results in trees.items():
        for case_id, result in results["cases"].items():
            if not case_id.startswith("sm100-"):
                continue
            reasons = [
                u["says"] for u in unresolvable if fnmatch.fnmatch(case_id, u["cases"])
            ]
            wrong += [
                f"{tree} {case_id}: {e['message'][:400]}"
                for e in result.get("errors", [])
                if not any(says in e["message"] for says in reasons)
            ]
    assert not wrong, "\n".join(wrong)


def test_fp8_ds_mla_layers_charge_656_byte_rows(
    trees: dict[str, dict[str, Any]],
) -> None:
    """Every MLA layer that stores fp8_ds_mla rows, in either tree, is charged
    FlashMLA's 656-byte row by its KV cache spec."""
    charged = {
        (tree, case_id): result["row_bytes"]
        for tree, results in trees.items()
        for case_id, result in results["cases"].items()
        if "row_bytes" in result
    }
    assert any(tree == "patched" and "glm512" in c for tree, c in charged)
    assert set(charged.values()) == {ROW_BYTES}
