# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset test`: the project's whole test command.

Parts, in order: the offline check; the tool's own tests; the model tests
on the pristine base, which must fail exactly as `ci/expected-base-failures.txt`
lists (proving each fix is red without the series); the model tests on the
patched tree, which must all pass; the test-tethering check; the lint.
"""

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from . import apply, check, envmgr, paths, runner, upstream
from .series import load_series

EXPECTED_BASE_FAILURES = paths.REPO / "ci" / "expected-base-failures.txt"
TETHERING = [
    "patchset_tool.tethering",
    "--tests",
    "tests",
    "--steps",
    "ci/test_areas",
    "--allowlist",
    "ci/tethering-allowlist.yaml",
]
LINT_PARTS = [
    ("test tethering", TETHERING),
    ("lint (ruff, ruff-format, mypy, typos, SPDX)", ["patchset_tool.lint"]),
]


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


def expected_base_failures() -> set[str]:
    lines = EXPECTED_BASE_FAILURES.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def _pytest(python: Path, part: Part, target: str, base: bool) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        command = [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            target,
            f"--junitxml={xml}",
            "-o",
            "junit_family=xunit1",
        ]
        print(f"\n=== {part.name}: {' '.join(command[1:4])} {target}", flush=True)
        rc = subprocess.run(
            command, env=runner.tree_env(python, base), cwd=paths.REPO
        ).returncode
        outcomes = junit_outcomes(xml) if xml.exists() else {}
    if not outcomes:
        part.problems.append(f"pytest exited {rc} and ran no test")
    for outcome in outcomes.values():
        setattr(part, outcome, getattr(part, outcome) + 1)
    return outcomes


def _expect_all_pass(part: Part, outcomes: dict[str, str]) -> None:
    failed = sorted(n for n, o in outcomes.items() if o == "failed")
    skipped = sorted(n for n, o in outcomes.items() if o == "skipped")
    part.problems += [f"failed: {n}" for n in failed]
    part.problems += [f"skipped (not allowed here): {n}" for n in skipped]


def _expect_base_red(part: Part, outcomes: dict[str, str]) -> None:
    """On the base, exactly the listed tests fail; every other one passes."""
    want = expected_base_failures()
    got = {n for n, o in outcomes.items() if o == "failed"}
    part.problems += [
        f"expected to fail on the base but passed: {n}" for n in sorted(want - got)
    ]
    part.problems += [
        f"failed on the base, not listed as expected: {n}" for n in sorted(got - want)
    ]
    part.problems += [f"skipped: {n}" for n, o in outcomes.items() if o == "skipped"]


def _command_part(name: str, command: list[str], python: Path) -> Part:
    part = Part(name)
    print(f"\n=== {name}", flush=True)
    start = time.monotonic()
    rc = subprocess.run(
        command, env=runner.tree_env(python, base=True), cwd=paths.REPO
    ).returncode
    part.seconds = time.monotonic() - start
    if rc:
        part.failed, part.problems = 1, [f"exited {rc}"]
    else:
        part.passed = 1
    return part


def run_tests() -> int:
    """Run every part; print the summary table; return 0 only if all pass."""
    python = envmgr.setup()
    runner.ensure_patched_tree(python)
    parts = []

    part, start = Part("check (offline consistency)"), time.monotonic()
    try:
        print("\n".join(check.check()))
        part.passed = 1
    except apply.PatchsetError as exc:
        part.failed, part.problems = 1, [str(exc)]
    part.seconds = time.monotonic() - start
    parts.append(part)

    for name, target, base, verdict in (
        ("machinery tests (tests/patchset)", "tests/patchset", False, _expect_all_pass),
        (
            "model tests on the pristine base",
            str(paths.MODEL_TESTS),
            True,
            _expect_base_red,
        ),
        (
            "model tests on the patched tree",
            str(paths.MODEL_TESTS),
            False,
            _expect_all_pass,
        ),
    ):
        part, start = Part(name), time.monotonic()
        verdict(part, _pytest(python, part, target, base))
        part.seconds = time.monotonic() - start
        parts.append(part)

    for name, module_args in LINT_PARTS:
        command = [str(python), "-m", *module_args]
        parts.append(_command_part(name, command, python))
    parts.append(_upstream_part(python))
    return _summarize(parts)


def _upstream_part(python: Path) -> Part:
    """The series on vLLM 0.33.0's real source tree: `git am -3`, then
    upstream's own tethering and SPDX hooks on the files it adds."""
    part, start = Part("upstream gates (vLLM 0.33.0 sdist checkout)"), time.monotonic()
    print(f"\n=== {part.name}", flush=True)
    changed = sorted(apply.touched_files(load_series(paths.PATCHES)))
    with tempfile.TemporaryDirectory() as tmp:
        clone = upstream.scratch_clone(Path(tmp))
        commands = [
            [
                sys.executable,
                str(paths.REPO / "scripts" / "patchset"),
                "apply",
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
    print(f"{'part':44} {'passed':>7} {'failed':>7} {'skipped':>7} {'seconds':>8}")
    for part in parts:
        mark = "" if part.ok else "  <-- FAILED"
        print(
            f"{part.name:44} {part.passed:7} {part.failed:7} {part.skipped:7} "
            f"{part.seconds:8.1f}{mark}"
        )
    for part in parts:
        for problem in part.problems:
            print(f"FAILED {part.name}: {problem}")
    bad = [p for p in parts if not p.ok]
    print(f"parts: {len(parts) - len(bad)} passed, {len(bad)} failed")
    return 1 if bad else 0
