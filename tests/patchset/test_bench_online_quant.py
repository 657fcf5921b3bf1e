# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The CPU side of benchmarks/bench_glm5_online_quant_linear.py: the
projection shapes it derives from GLM-5.3-Flash's config, the sums it reports,
and how `scripts/patchset gpu --bench quant` runs it."""

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from patchset_tool import gpu, paths

BENCH = paths.REPO / "benchmarks" / gpu.QUANT_BENCH_SCRIPT


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_quant", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench()


@pytest.fixture(scope="module")
def config(bench: ModuleType) -> dict:
    return bench.load_config(paths.SUITE / "glm-5.3-flash-config.json")


def installed_vllm_file(relpath: str) -> Path:
    """A file of the vLLM installed beside this interpreter, without
    importing vLLM."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / relpath


def sm121_skinny_gemm_shapes() -> set[tuple[int, int]]:
    """The (N, K) keys of vLLM's SM121 skinny-GEMM plans, which vLLM measured
    on GLM-5.3-Flash's local shapes at TP 2 (read from its source)."""
    path = installed_vllm_file(
        "model_executor/kernels/linear/cute_dsl/skinny_gemm_plans.py"
    )
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "SM121_SKINNY_GEMM_PLANS"
            and isinstance(node.value, ast.Dict)
        ):
            return {ast.literal_eval(key) for key in node.value.keys if key is not None}
    raise AssertionError(f"{path} defines no SM121_SKINNY_GEMM_PLANS")


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_target_sets_hold_the_descriptions_196_and_128(bench, config, tp):
    """The counts the 001 description and `patchset coverage` give."""
    sets = bench.target_sets(bench.projections(config, tp))
    assert sum(p.count for p in sets["all_196"]) == 196
    assert sum(p.count for p in sets["non_kda_128"]) == 128
    assert {p.group for p in sets["non_kda_128"]} == {"mla", "shared_expert"}


def test_tp2_shapes_are_those_vllm_planned_for_glm(bench, config):
    """Every projection but the indexer's wq_b has the local shape at TP 2
    that vLLM keyed a skinny-GEMM plan for GLM-5.3-Flash with."""
    planned = sm121_skinny_gemm_shapes()
    shapes = {
        p.name: (p.n, p.k)
        for p in bench.projections(config, 2)
        if p.name != "mla.indexer.wq_b"
    }
    assert {name: s for name, s in shapes.items() if s not in planned} == {}


def test_tp_shards_follow_the_layer_classes(bench, config):
    """Column-parallel layers split N, row-parallel K, replicated neither;
    KDA's f_a|g_a shards stay whole on every rank."""
    one = {p.name: (p.n, p.k) for p in bench.projections(config, 1)}
    eight = {p.name: (p.n, p.k) for p in bench.projections(config, 8)}
    head_dim = config["linear_attn_config"]["head_dim"]
    assert (
        eight["kda.in_proj_qkvbfg_a"][0] - 2 * head_dim
        == (one["kda.in_proj_qkvbfg_a"][0] - 2 * head_dim) // 8
    )
    for name in ("mla.q_b_proj", "shared_experts.gate_up_proj"):
        assert eight[name] == (one[name][0] // 8, one[name][1])
    for name in ("kda.o_proj", "mla.o_proj", "shared_experts.down_proj"):
        assert eight[name] == (one[name][0], one[name][1] // 8)
    for name in ("mla.fused_qkv_a_proj", "mla.indexer.wq_b"):
        assert eight[name] == one[name]


def test_a_tp_size_that_does_not_divide_the_heads_is_refused(bench, config):
    with pytest.raises(ValueError, match="TP 3"):
        bench.projections(config, 3)


def test_distinct_shapes_are_measured_once(bench, config):
    by_tp = {tp: bench.projections(config, tp) for tp in (1, 8)}
    shapes = bench.distinct_shapes(by_tp)
    assert len(shapes) == len(set(shapes))
    assert {(p.n, p.k) for ps in by_tp.values() for p in ps} == set(shapes)


def test_summed_times_keep_the_rest_bf16_and_propagate_gaps(bench, config):
    projs = bench.projections(config, 8)
    kda_in = next(p for p in projs if p.name == "kda.in_proj_qkvbfg_a")
    times = {
        (p.n, p.k): {"bf16": 2.0, "q": None if p is kda_in else 1.0} for p in projs
    }
    sums = bench.summed_times(projs, times, ("bf16", "q"))
    kda_count = sum(p.count for p in projs if p.group == "kda")
    assert sums["non_kda_128"]["bf16"] == 2.0 * 128
    assert sums["non_kda_128"]["q"] == 1.0 * 128
    assert sums["non_kda_128"]["step_q"] == 1.0 * 128 + 2.0 * kda_count
    assert sums["all_196"]["q"] is None
    assert sums["all_196"]["step_q"] is None
    assert sums["all_196"]["step_bf16"] == 2.0 * 196


def test_device_command_runs_the_benchmark_alone():
    command = gpu.device_command(
        "build/gpu/stage-quant", bench=True, script=gpu.QUANT_BENCH_SCRIPT, tests=False
    )
    assert "pytest" not in command
    assert f"python3 bench/{gpu.QUANT_BENCH_SCRIPT} --json $OUT/bench.json" in command
    assert "cp -r build/gpu/stage-quant/. $S/" in command


def test_stage_holds_the_benchmark_its_helpers_and_vllms_sources(tmp_path, monkeypatch):
    """A stage with the benchmark alone: no tests, the files it reads beside
    it, and the vLLM sources it parses (here from a fake site-packages, whose
    fake extensions are not stripped)."""
    monkeypatch.setattr(gpu, "without_static_symbols", lambda src, _work: src)
    site = tmp_path / "site"
    pkg = site / "vllm"
    for rel in (*gpu.EXTENSIONS, *gpu.PYTHON_FILES, *gpu.QUANT_PYTHON_FILES):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_bytes(b"x")
    (pkg / "_version.py").write_text("__version__ = version = '9.9.9'\n")
    helper = tmp_path / "helper.json"
    helper.write_text("{}")
    dest = gpu.stage(
        site,
        [],
        tmp_path / "stage",
        cache_dir=tmp_path / "xz",
        bench=BENCH,
        bench_files=(helper,),
        python_files=gpu.PYTHON_FILES + gpu.QUANT_PYTHON_FILES,
    )
    assert sorted(p.name for p in (dest / "bench").iterdir()) == sorted(
        [BENCH.name, "helper.json"]
    )
    assert list((dest / "tests").iterdir()) == []
    for rel in gpu.QUANT_PYTHON_FILES:
        assert (dest / "vllm" / rel).is_file()
