# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset test`: the project's whole test command.

Parts, in order: the offline check of every base; the tool's own tests;
then for each base: the model tests on its pristine release source, which
must fail exactly as `patches/<version>/expected-base-failures.txt` lists
(proving each fix is red without the series), and on the patched source,
which must all pass. Both run as upstream CI runs them, from the
checkout's `tests/` with upstream's conftest, beside upstream's own
glm5next tests. Only the tests in `expected-skips.txt` (which need a GPU)
may skip, and only those in `expected-cpu-failures.txt` (upstream's own,
failing on a CPU-only host with or without the series) may fail on both.
Then the test-tethering check, the lint, and per base the upstream gates
on the release source.
"""

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from . import apply, check, envmgr, paths, runner, sourcetree, upstream
from .bases import Base
from .series import load_series

TETHERING = [
    "patchset_tool.tethering",
    "--tests",
    "tests",
    "--steps",
    "ci/test_areas",
    "--allowlist",
    "ci/tethering-allowlist.yaml",
]
LINT = ["patchset_tool.lint"]


@dataclass
class Part:
    name: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def junit_outcomes(xml: Path) -> dict[str, str]:
    """Map each test's node id to passed, failed or skipped."""
    outcomes = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}"
        tags = {child.tag for child in case}
        outcomes[node] = (
            "failed"
            if tags & {"failure", "error"}
            else "skipped"
            if "skipped" in tags
            else "passed"
        )
    return outcomes


def node_list(path: Path) -> set[str]:
    """The node ids listed in `path`, one per line; # starts a comment."""
    if not path.is_file():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


def _pytest(
    command: list[str], part: Part, cwd: Path, env: dict[str, str]
) -> dict[str, str]:
    """Run pytest `command` (without its junit option); count outcomes."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        print(f"\n=== {part.name}: {' '.join(command[1:])}", flush=True)
        rc = subprocess.run(
            [*command, f"--junitxml={xml}", "-o", "junit_family=xunit1"],
            env=env,
            cwd=cwd,
        ).returncode
        outcomes = junit_outcomes(xml) if xml.exists() else {}
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


def _model_tests(python: Path, base: Base, patched: bool) -> Part:
    """The model tests of one base's source tree, run as upstream CI runs
    them: `pytest -v -s models/glm5next` from its tests/ folder."""
    tree = "patched" if patched else "pristine"
    part, start = Part(f"{base.version}: model tests, {tree} source"), time.monotonic()
    command = [str(python), "-m", "pytest", "-v", "-s", "-p", "no:cacheprovider"]
    with sourcetree.checkout_for_tests(base, patched) as checkout:
        outcomes = _pytest(
            [*command, "models/glm5next"],
            part,
            checkout / "tests",
            sourcetree.checkout_env(python, base, checkout),
        )
    failures = node_list(base.expected_cpu_failures)
    if not patched:
        failures |= node_list(base.expected_base_failures)
    _expect(part, outcomes, failures, node_list(base.expected_skips))
    part.seconds = time.monotonic() - start
    return part


def _command_part(name: str, command: list[str], env: dict[str, str]) -> Part:
    part = Part(name)
    print(f"\n=== {name}", flush=True)
    start = time.monotonic()
    rc = subprocess.run(command, env=env, cwd=paths.REPO).returncode
    part.seconds = time.monotonic() - start
    if rc:
        part.failed, part.problems = 1, [f"exited {rc}"]
    else:
        part.passed = 1
    return part


def _check_part() -> Part:
    part, start = Part("check (offline consistency, every base)"), time.monotonic()
    try:
        print("\n".join(check.check()))
        part.passed = 1
    except apply.PatchsetError as exc:
        part.failed, part.problems = 1, [str(exc)]
    part.seconds = time.monotonic() - start
    return part


def run_tests(bases: list[Base]) -> int:
    """Run every part for `bases` (the first one also runs the tool's own
    tests and the lint); print the summary table; 0 only if all pass."""
    pythons = {b.version: envmgr.setup(b) for b in bases}
    for base in bases:
        runner.ensure_patched_tree(base)
    first = bases[0]
    tool_env = runner.tree_env(pythons[first.version], first, pristine=True)
    parts = [_check_part()]
    part, start = Part("machinery tests (tests/patchset)"), time.monotonic()
    command = [str(pythons[first.version]), "-m", "pytest", "-q", "-p"]
    _expect(
        part,
        _pytest(
            [*command, "no:cacheprovider", "tests/patchset"], part, paths.REPO, tool_env
        ),
    )
    part.seconds = time.monotonic() - start
    parts.append(part)
    for base in bases:
        for patched in (False, True):
            parts.append(_model_tests(pythons[base.version], base, patched))
    python = str(pythons[first.version])
    parts.append(_command_part("test tethering", [python, "-m", *TETHERING], tool_env))
    parts.append(
        _command_part(
            "lint (ruff, ruff-format, mypy, typos, SPDX)",
            [python, "-m", *LINT],
            tool_env,
        )
    )
    for base in bases:
        parts.append(_upstream_part(pythons[base.version], base))
    return _summarize(parts)


def _upstream_part(python: Path, base: Base) -> Part:
    """The series on the base's real release source: `git am -3`, then
    upstream's own tethering and SPDX hooks on the files it changes."""
    part = Part(f"{base.version}: upstream gates (release source)")
    start = time.monotonic()
    print(f"\n=== {part.name}", flush=True)
    changed = sorted(apply.touched_files(load_series(base.patches)))
    with tempfile.TemporaryDirectory() as tmp:
        clone = upstream.scratch_clone(Path(tmp), base)
        commands = [
            [
                sys.executable,
                str(paths.REPO / "scripts" / "patchset"),
                "apply",
                "--base",
                base.version,
                "--vllm-src",
                str(clone),
            ],
            [
                str(python),
                "tools/pre_commit/check_spdx_header.py",
                *[c for c in changed if c.endswith(".py")],
            ],
        ]
        for command in commands:
            rc = subprocess.run(command, cwd=clone).returncode
            if rc:
                part.problems.append(f"exited {rc}: {' '.join(command[-3:])}")
    part.passed, part.failed = (0, 1) if part.problems else (1, 0)
    part.seconds = time.monotonic() - start
    return part


def _summarize(parts: list[Part]) -> int:
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
    print(f"parts: {len(parts) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0
