# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset gpu`: what a base's stage for the H200 machine holds, and
staging it (see gpu.py for the stage itself)."""

from pathlib import Path

from . import envmgr, gitutil, gpu, gpu_flashinfer, paths
from .bases import Base
from .errors import PatchsetError
from .junit import read_node_list
from .series import Series

BENCHMARK = paths.REPO / "benchmarks" / gpu.BENCH_SCRIPT
QUANT_BENCHMARK = paths.REPO / "benchmarks" / gpu.QUANT_BENCH_SCRIPT


def gpu_test_files(series: Series) -> list[Path]:
    """The tests to stage for an SM90 GPU: the files of the verification
    suite (one copy for every base) that its expected-skips list names, and
    any other test file of the series that its base's list names (the
    suite's copy wins over a series file of the same name)."""
    base = series.base
    suite = sorted(
        {
            paths.REPO / name.split("::", 1)[0]
            for name in read_node_list(paths.SUITE_EXPECTED_SKIPS)
        }
    )
    skipped = {name.split("::", 1)[0] for name in read_node_list(base.expected_skips)}
    ours = sorted(skipped & set(series.test_files))
    names = {test.name for test in suite}
    return suite + [base.copy_of(f) for f in ours if Path(f).name not in names]


def results_dir(base: Base) -> Path:
    """Where `gpu --collect` puts a device run's files for `base`."""
    return paths.build_dir() / "gpu" / f"results-{base.version}"


def _stage_rel(dest: Path) -> str:
    return dest.relative_to(paths.REPO).as_posix()


def _flashinfer_archives(base: Base) -> tuple[Path, ...]:
    """The FlashInfer archive that the decode benchmark needs (made here
    with nvcc), for the primary base only."""
    if not base.primary:
        return ()
    python = envmgr.env_python(base)
    assert python is not None
    return (
        gpu_flashinfer.archive(
            envmgr.site_packages(python),
            python,
            paths.cache_root() / "gpu-flashinfer",
        ),
    )


def stage_tests(series: Series, bench: bool) -> str:
    """Stage the SM90 tests of `series` (with `bench`, the decode
    benchmark too) for the H200; return what to run there."""
    base = series.base
    dest = paths.build_dir() / "gpu" / f"stage-{base.version}"
    tests = gpu_test_files(series)
    if not tests:
        raise PatchsetError(f"{base.expected_skips}: names no GPU test to stage")
    try:
        gitutil.publish_folder(
            dest,
            lambda new: gpu.stage(
                base.patched_tree(),
                tests,
                new,
                cache_dir=paths.cache_root() / "gpu-xz",
                bench=BENCHMARK if bench else None,
                archives=_flashinfer_archives(base) if bench else (),
                beside=gitutil.working_tree_bytes(paths.REPO),
            ),
        )
    except ValueError as exc:
        raise PatchsetError(str(exc)) from exc
    stage_rel = _stage_rel(dest)
    return (
        f"staged {len(tests)} test file(s) for vLLM {base.version} in {dest}.\n"
        f"On the H200, from a copy of this repository carrying {stage_rel}, run:\n"
        f"  {gpu.device_command(stage_rel, bench=bench)}\n"
        "then bring back $OUT and run: "
        f"scripts/patchset gpu --base {base.version} --collect DIR"
    )


def stage_quant_bench(base: Base) -> str:
    """Stage the online-quantization benchmark alone (no tests), with the
    verification suite's config.json of GLM-5.3-Flash; return what to run
    on the H200."""
    dest = paths.build_dir() / "gpu" / f"stage-quant-{base.version}"
    config = paths.SUITE / "glm-5.3-flash-config.json"
    try:
        gitutil.publish_folder(
            dest,
            lambda new: gpu.stage(
                base.patched_tree(),
                [],
                new,
                cache_dir=paths.cache_root() / "gpu-xz",
                bench=QUANT_BENCHMARK,
                bench_files=(BENCHMARK, config),
                python_files=gpu.PYTHON_FILES + gpu.QUANT_PYTHON_FILES,
                beside=gitutil.working_tree_bytes(paths.REPO),
            ),
        )
    except (FileNotFoundError, ValueError) as exc:
        raise PatchsetError(str(exc)) from exc
    stage_rel = _stage_rel(dest)
    command = gpu.device_command(
        stage_rel, bench=True, script=gpu.QUANT_BENCH_SCRIPT, tests=False
    )
    return (
        f"staged the online-quantization benchmark for vLLM {base.version} in "
        f"{dest}.\nOn the H200, from a copy of this repository carrying "
        f"{stage_rel}, run:\n  {command}\nthen bring back $OUT and run: "
        f"scripts/patchset gpu --base {base.version} --collect DIR"
    )
