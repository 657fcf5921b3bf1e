# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`bisect-run`'s exit codes: only a test verdict is 0 or 1; what the tool
cannot judge skips the commit (125) or aborts the bisect (>= 128)."""

from pathlib import Path

import pytest
from projectkit import INIT, Project, git
from test_checkout import checkout  # noqa: F401 (fixture)

from patchset_tool import bisect


@pytest.mark.parametrize(
    "pytest_rc, told",
    [(0, 0), (1, 1), (2, 125), (3, 125), (4, 255), (5, 125), (-9, 137)],
)
def test_only_pytests_verdicts_are_good_or_bad(pytest_rc: int, told: int) -> None:
    assert bisect.verdict(pytest_rc) == told


@pytest.mark.parametrize(
    "args",
    [
        ["--vllm-src", "/nonexistent/vllm"],
        ["--vllm-scr", "/nonexistent/vllm"],
        [],
        ["--base", "9.9.9", "--vllm-src", "."],
    ],
    ids=["mistyped-path", "mistyped-option", "no-vllm-src", "unknown-base"],
)
def test_bad_input_aborts_the_bisect(project: Project, args: list[str]) -> None:
    result = project.patchset("bisect-run", *args)
    assert result.returncode == 255, result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_dirty_checkout_aborts_the_bisect(
    project: Project,
    checkout: Path,  # noqa: F811
) -> None:
    (checkout / INIT).write_text("# local edit\n")
    result = project.patchset("bisect-run", "--vllm-src", str(checkout))
    assert result.returncode == 255, result.stdout + result.stderr
    assert "uncommitted changes" in result.stderr
    assert "aborts the bisect" in result.stderr


def test_runs_inside_a_bisect(
    project: Project,
    checkout: Path,  # noqa: F811
) -> None:
    """`git bisect run` calls it with the bisect in progress: not refused
    (here no declared release precedes the commit, so it is skipped)."""
    git("bisect", "start", cwd=checkout)
    result = project.patchset("bisect-run", "--vllm-src", str(checkout))
    assert result.returncode == 125, result.stdout + result.stderr
    assert "no declared release precedes it" in result.stdout


def test_help_documents_the_exit_codes(project: Project) -> None:
    text = " ".join(project.patchset("bisect-run", "--help").stdout.split())
    for words in ("0 the tests pass, 1 they fail (the only verdicts)", "125 ", "255"):
        assert words in text
