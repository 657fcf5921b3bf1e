# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset test`: the project's whole test command, its parts as the
README's table lists them. They are independent processes, up to `jobs` side
by side (the longest first), each logging to build/test-logs/; the summary
table ends the run, with the tail of each failed part's log.
"""

import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from . import (
    apply,
    check,
    envmgr,
    neighbours,
    paths,
    runner,
    sourcetree,
    upstream,
    upstream_checks,
)
from .bases import Base
from .errors import PatchsetError
from .junit import read_node_list, read_outcomes
from .series import Series

LOG_TAIL_LINES = 60


@dataclass
class Part:
    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    log: Path | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def count(self, rc: int) -> None:
        """One pass or one failure for a command that exited `rc`."""
        if rc:
            self.failed, self.problems = self.failed + 1, [f"exited {rc}"]
        else:
            self.passed += 1


SM90_GPU_ONLY_VAR = "GLM5NEXT_SM90_GPU_ONLY"
"""Where `glm5next_sm90_host` reads the tests it skips (see that plugin)."""
CPU_HOST, SM90_HOST = "CPU host", "emulated SM90 host"


def model_part(version: str, patched: bool, host: str = CPU_HOST) -> str:
    """The name of a base's model-tests part (its log: `log_path`)."""
    return (
        f"{version}: model tests, {'patched' if patched else 'pristine'} source, {host}"
    )


def neighbours_part(version: str) -> str:
    return f"{version}: upstream neighbours, none worse patched"


def log_path(name: str) -> Path:
    """build/test-logs/<name as a file name>.log"""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", name).strip("-")
    return paths.build_dir() / "test-logs" / f"{slug}.log"


def _run_logged(part: Part, command: list[str], cwd: Path, env: dict[str, str]) -> int:
    """Run `command`, appending its output to the part's log; its exit code."""
    assert part.log is not None
    with part.log.open("a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(command)}\n")
        log.flush()
        return subprocess.run(
            command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
        ).returncode


def _pytest(
    part: Part, command: list[str], cwd: Path, env: dict[str, str]
) -> dict[str, str]:
    """Run pytest `command` (without its junit option); count outcomes
    (an error counts as a failure)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        rc = _run_logged(
            part, [*command, f"--junitxml={xml}", "-o", "junit_family=xunit1"], cwd, env
        )
        outcomes = read_outcomes(xml) if xml.exists() else {}
    outcomes = {n: "failed" if o == "error" else o for n, o in outcomes.items()}
    if not outcomes:
        part.problems.append(f"pytest exited {rc} and ran no test")
    for outcome in outcomes.values():
        setattr(part, outcome, getattr(part, outcome) + 1)
    return outcomes


def _expect(
    part: Part,
    outcomes: dict[str, str],
    failures: frozenset[str] | set[str] = frozenset(),
    skips: frozenset[str] | set[str] = frozenset(),
) -> None:
    """Exactly `failures` fail and exactly `skips` skip; the rest pass."""
    for outcome, want in (("failed", failures), ("skipped", skips)):
        got = {n for n, o in outcomes.items() if o == outcome}
        part.problems += [
            f"expected to be {outcome} but was {outcomes.get(n, 'not run')}: {n}"
            for n in sorted(want - got)
        ]
        part.problems += [f"{outcome}, not listed: {n}" for n in sorted(got - want)]


def tool_tests(part: Part, python: Path, env: dict[str, str], workers: int) -> None:
    """The tool's own tests, over `workers` processes; one tree's reports
    stay on one worker (`xdist_group`), so each tree's batch runs once."""
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["--durations=25"]
    if workers > 1:
        command += ["-n", str(workers), "--dist", "loadgroup"]
    outcomes = _pytest(part, [*command, "tests/patchset"], paths.REPO, env)
    _expect(part, outcomes, skips=_tool_tests_skipped_here(env))


ENGINE_STACK_TEST = (
    "tests/patchset/test_gpu_engine.py::"
    "test_stage_builds_fits_and_imports_on_the_device_stack"
)


def _tool_tests_skipped_here(env: dict[str, str]) -> set[str]:
    """The tool tests that skip by design in `env`: the engine stage's
    import check needs a venv of the GPU machine's packages, named by
    GLM5NEXT_ENGINE_PYTHON."""
    return set() if env.get("GLM5NEXT_ENGINE_PYTHON") else {ENGINE_STACK_TEST}


def upstream_tests_touched(series: Series) -> list[str]:
    """The test files outside tests/models/glm5next that `series` changes or
    adds, as paths under tests/."""
    model_tests = f"{paths.MODEL_TESTS.as_posix()}/"
    return [
        path.removeprefix("tests/")
        for path in series.touched
        if path.startswith("tests/")
        and not path.startswith(model_tests)
        and Path(path).name.startswith("test_")
    ]


def model_tests(
    part: Part, python: Path, base: Base, patched: bool = True, sm90: bool = False
) -> None:
    """One base's model tests as upstream CI runs them: `pytest -v -s
    models/glm5next` from tests/ of the patched release checkout on this CPU
    host (`glm5next_cpu_host`); exactly `expected-cpu-failures.txt` fail and
    `expected-skips.txt` skip. With `sm90`, upstream's test files the series
    changes too, with vLLM's platform answering as an SM90 GPU for the whole
    session (`glm5next_sm90_host`): exactly `expected-sm90-failures.txt`
    fail and `expected-sm90-skips.txt` (they need a real GPU) skip.

    Pristine (on the emulated SM90 host, where fewer of them skip), the
    series' own test files run on the release checkout, where those of
    `expected-base-failures.txt` fail, and so do the host's listed failures,
    run by node id: they are upstream's, not the series'."""
    series = Series.load(base)
    files = ["models/glm5next", *(upstream_tests_touched(series) if sm90 else [])]
    failures, skips = (
        (base.expected_sm90_failures, base.expected_sm90_skips)
        if sm90
        else (base.expected_cpu_failures, base.expected_skips)
    )
    failing = read_node_list(failures)
    if not patched:
        files = [p.removeprefix("tests/") for p in series.test_files]
        if not files:
            part.problems.append("the series adds no test file to run pristine")
            return
        files += sorted(n.removeprefix("tests/") for n in failing)
    command = [str(python), "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider"]
    with sourcetree.checkout_for_tests(base, patched) as checkout:
        tree = "checkout-patched" if patched else "checkout-pristine"
        env = sourcetree.checkout_env(python, base, checkout, tree)
        command += sourcetree.cpu_host_plugin(env)
        if sm90:
            command += ["-p", "glm5next_sm90_host"]
            env[SM90_GPU_ONLY_VAR] = str(skips)
        outcomes = _pytest(part, [*command, *files], checkout / "tests", env)
    skipping = read_node_list(skips)
    if not patched:  # only some files ran; every red test must be among them
        ran = tuple(f"tests/{f}" for f in files)
        skipping = {n for n in skipping if n.startswith(ran)}
        failing |= read_node_list(base.expected_base_failures)
    _expect(part, outcomes, failing, skipping)


def verification_suite(part: Part, python: Path, base: Base) -> None:
    """This project's verification suite (tests/models/glm5next, one copy for
    every base) on `base`: its selection matrix resolves every case on the
    base's pristine install and on its patched tree in the same run. Only the
    tests in the suite's expected-skips.txt (which need a GPU) may skip."""
    command = [str(python), "-m", "pytest", "-v", "-p", "no:cacheprovider"]
    suite = paths.SUITE.relative_to(paths.REPO).as_posix()
    env = runner.suite_env(python, base)
    outcomes = _pytest(part, [*command, suite], paths.REPO, env)
    _expect(part, outcomes, skips=read_node_list(paths.SUITE_EXPECTED_SKIPS))


def _apply_to_checkout(part: Part, series: Series, clone: Path, python: Path) -> int:
    """What `apply --vllm-src` does, logged: `git am -3` the series onto
    `clone`, then the checkout's own tethering hook on its new tests."""
    assert part.log is not None
    with part.log.open("a", encoding="utf-8") as log:
        log.write(f"$ patchset apply --base {series.base.version} --vllm-src {clone}\n")
        try:
            count, seconds = apply.apply_to_checkout(series, clone, check=False)
        except PatchsetError as exc:
            log.write(f"patchset: error: {exc}\n")
            return exc.exit_code
        log.write(f"applied {count} patches with git am -3 ({seconds:.2f} s)\n")
        return upstream_checks.tether_new_tests(series, clone, python, log)


def upstream_gates(part: Part, python: Path, base: Base) -> None:
    """The series on the base's real release source: `git am -3`, then
    upstream's own tethering and SPDX hooks on the files it changes."""
    series = Series.load(base)
    changed = sorted(series.touched)
    with tempfile.TemporaryDirectory() as tmp:
        clone = upstream.scratch_clone(Path(tmp), base)
        rc = _apply_to_checkout(part, series, clone, python)
        if rc:
            part.problems.append(f"exited {rc}: apply --vllm-src {clone}")
        spdx = [
            str(python),
            "tools/pre_commit/check_spdx_header.py",
            *[c for c in changed if c.endswith(".py")],
        ]
        rc = _run_logged(part, spdx, clone, dict(os.environ))
        if rc:
            part.problems.append(f"exited {rc}: {' '.join(spdx[-3:])}")
    part.passed, part.failed = (0, 1) if part.problems else (1, 0)


def upstream_checks_part(part: Part, python: Path, base: Base) -> None:
    """Upstream's tethering and SPDX checks over this repository, logged."""
    assert part.log is not None
    with part.log.open("a", encoding="utf-8") as log:
        part.count(upstream_checks.run_checks(base, python, out=log))


def _check_part() -> Part:
    part, start = Part("check (offline consistency, every base)"), time.monotonic()
    try:
        print("\n".join(check.check()))
        part.passed = 1
    except PatchsetError as exc:
        part.failed, part.problems = 1, [str(exc)]
    part.seconds = time.monotonic() - start
    return part


Job = tuple[Part, Callable[[Part], None]]


def _run_part(job: Job, lock: threading.Lock) -> Part:
    part, work = job
    part.log = log_path(part.name)
    part.log.parent.mkdir(parents=True, exist_ok=True)
    part.log.write_text("", encoding="utf-8")
    with lock:
        print(f"--- start  {part.name}  (log: {part.log})", flush=True)
    start = time.monotonic()
    try:
        work(part)
    except Exception as exc:  # a crash is that part's failure, not the run's
        part.failed += 1
        part.problems.append(f"{type(exc).__name__}: {exc}")
    part.seconds = time.monotonic() - start
    with lock:
        state = "ok" if part.ok else "FAILED"
        print(f"--- {state:6} {part.name}  ({part.seconds:.0f} s)", flush=True)
    return part


def run_tests(bases: list[Base], jobs: int = 2) -> int:
    """Run every part for `bases` (the first one also runs the tool's own
    tests, the lint and upstream's checks), `jobs` parts at a time; print
    the summary table; 0 only if all pass."""
    start = time.monotonic()
    pythons = {b.version: envmgr.setup(b) for b in bases}
    for base in bases:
        runner.ensure_patched_tree(base)
    upstream.release_history()  # fetched once, before parts share it
    first = bases[0]
    python = pythons[first.version]
    tool_env = runner.tree_env(python, first, pristine=True)

    def command(argv: list[str]) -> Callable[[Part], None]:
        return lambda part: part.count(_run_logged(part, argv, paths.REPO, tool_env))

    # Longest first, so that the short parts fill the gaps at the end.
    work: list[Job] = []

    def add(name: str, run_part: Callable[..., None], base: Base, **kw) -> None:
        job = partial(run_part, python=pythons[base.version], base=base, **kw)
        work.append((Part(name), job))

    tool_part = Part("machinery tests (tests/patchset)")
    work.append((tool_part, lambda part: tool_tests(part, python, tool_env, jobs)))
    for base in bases:
        add(neighbours_part(base.version), neighbours.run_part, base)
    for base in bases:
        add(model_part(base.version, True, SM90_HOST), model_tests, base, sm90=True)
    for base in bases:
        name = f"{base.version}: verification suite, pristine vs patched"
        add(name, verification_suite, base)
    for base in bases:
        add(model_part(base.version, True), model_tests, base)
        name = model_part(base.version, False, SM90_HOST)
        add(name, model_tests, base, patched=False, sm90=True)
    lint = command([str(python), "-m", "patchset_tool.lint"])
    work.append((Part("lint (ruff, ruff-format, mypy, typos)"), lint))
    add("upstream checks (tethering, SPDX)", upstream_checks_part, first)
    for base in bases:
        add(f"{base.version}: upstream gates (release source)", upstream_gates, base)
    parts = [_check_part()]
    lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        parts += list(pool.map(lambda job: _run_part(job, lock), work))
    return _summarize(parts, time.monotonic() - start)


def _log_tail(log: Path) -> str:
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _summarize(parts: list[Part], wall: float) -> int:
    for part in parts:
        if not part.ok and part.log is not None:
            print(f"\n=== {part.name}: last lines of {part.log}")
            print(_log_tail(part.log))
    print("\n" + "=" * 78)
    print(f"{'part':48} {'passed':>7} {'failed':>7} {'skipped':>7} {'seconds':>8}")
    for part in parts:
        mark = "" if part.ok else "  <-- FAILED"
        print(
            f"{part.name:48} {part.passed:7} {part.failed:7} {part.skipped:7} "
            f"{part.seconds:8.1f}{mark}"
        )
    for part in parts:
        for problem in part.problems:
            print(f"FAILED {part.name}: {problem}")
    bad = [p for p in parts if not p.ok]
    print(
        f"parts: {len(parts) - len(bad)} passed, {len(bad)} failed; "
        f"{wall:.0f} s wall clock (parts side by side, so seconds add up to more)"
    )
    return 1 if bad else 0
