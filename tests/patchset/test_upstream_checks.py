# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's own tethering and SPDX scripts guard this repository's tests:
an untethered or headerless test file fails, an allowlisted one (with its
reason) passes, and the checked files are left as they were."""

from pathlib import Path

import pytest
from projectkit import SPDX

from patchset_tool import bases, envmgr, upstream_checks

STEP = """\
steps:
- label: GLM5Next
  key: glm5next-unit-tests
  working_dir: "/vllm-workspace/tests"
  commands:
    - pytest -v -s models/glm5next
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository shaped like this one: one CI step, one tethered test."""
    root = tmp_path / "repo"
    (root / "ci" / "test_areas").mkdir(parents=True)
    (root / "ci" / "test_areas" / "glm5next.yaml").write_text(STEP)
    test = root / "tests" / "models" / "glm5next" / "test_tethered.py"
    test.parent.mkdir(parents=True)
    test.write_text(SPDX + "def test_a():\n    pass\n")
    return root


def tethering(repo: Path) -> tuple[bool, str]:
    base = bases.get_base()
    python = envmgr.env_python(base)
    assert python is not None
    return upstream_checks.check_tethering(base, python, repo, [repo / "tests"])


def test_tethered_tests_pass(repo: Path) -> None:
    ok, output = tethering(repo)
    assert ok, output


def test_untethered_test_file_fails(repo: Path) -> None:
    stray = repo / "tests" / "other" / "test_stray.py"
    stray.parent.mkdir()
    stray.write_text(SPDX + "def test_b():\n    pass\n")
    ok, output = tethering(repo)
    assert not ok
    assert "tests/other/test_stray.py is not run by any Buildkite job" in output
    (repo / upstream_checks.ALLOWLIST).write_text(
        "tests/other/test_stray.py  # needs 8 GPUs\n"
    )
    ok, output = tethering(repo)
    assert ok, output


def test_missing_spdx_header_fails_and_the_file_is_kept(repo: Path) -> None:
    bare = repo / "tests" / "models" / "glm5next" / "test_bare.py"
    bare.write_text("def test_c():\n    pass\n")
    base = bases.get_base()
    python = envmgr.env_python(base)
    assert python is not None
    files = upstream_checks.spdx_files(repo)
    ok, output = upstream_checks.check_spdx(base, python, repo, files)
    assert not ok
    assert "tests/models/glm5next/test_bare.py" in output
    assert bare.read_text() == "def test_c():\n    pass\n"


def test_upstream_test_file_run_by_an_upstream_step_passes(repo: Path) -> None:
    """A test file of upstream's that the series changes (laid over from an
    overlay) is tethered by the base's own step that runs it."""
    overlay = repo / "overlay" / "tests" / "v1" / "attention"
    overlay.mkdir(parents=True)
    (overlay / "test_upstream_selection.py").write_text(
        SPDX + "def test_d():\n    pass\n"
    )
    base = bases.get_base()
    python = envmgr.env_python(base)
    assert python is not None
    ok, output = upstream_checks.check_tethering(
        base, python, repo, [repo / "tests", repo / "overlay" / "tests"]
    )
    assert ok, output
