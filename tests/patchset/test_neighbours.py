# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's neighbouring tests (ci/upstream_neighbours.txt), run pristine
vs patched by `patchset test`, and the `ci-impact` report."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from projectkit import REPO

from patchset_tool import bases, neighbours, sourcetree, upstream
from patchset_tool.errors import PatchsetError
from patchset_tool.testcmd import Part


def test_every_declared_file_is_in_a_declared_release():
    history = upstream.release_history()
    tags = [b.tag for b in bases.load_bases()]
    for entry in neighbours.load():
        found = [
            t
            for t in tags
            if subprocess.run(
                ["git", "cat-file", "-e", f"{t}:{entry.path}"], cwd=history
            ).returncode
            == 0
        ]
        assert found, f"{entry.path} is in none of {tags}"


@pytest.mark.parametrize(
    "line",
    ["models/test_x.py", "tests/test_x.py  because", "tests/test_x.txt"],
)
def test_a_malformed_line_is_refused(tmp_path, line):
    listing = tmp_path / "neighbours.txt"
    listing.write_text(f"# comment\n{line}\n")
    with pytest.raises(PatchsetError, match=r"neighbours.txt:2: expected"):
        neighbours.load(listing)


def test_skip_keeps_the_reason(tmp_path):
    listing = tmp_path / "neighbours.txt"
    listing.write_text("tests/a/test_x.py\ntests/b/test_y.py  skip: needs a GPU\n")
    assert neighbours.load(listing) == [
        neighbours.Neighbour("tests/a/test_x.py"),
        neighbours.Neighbour("tests/b/test_y.py", "needs a GPU"),
    ]


def fake_checkouts(root: Path, pristine_passes: bool):
    """Two tiny checkouts holding `tests/a/test_x.py`: its `test_a` passes
    in both; its `test_b` fails patched and, unless `pristine_passes`,
    pristine."""
    trees = {}
    for patched in (False, True):
        tests = root / str(patched) / "tests" / "a"
        tests.mkdir(parents=True)
        fails = patched or not pristine_passes
        tests.joinpath("test_x.py").write_text(
            f"def test_a():\n    pass\n\n\ndef test_b():\n    assert not {fails}\n"
        )
        trees[patched] = root / str(patched)

    @contextlib.contextmanager
    def checkout_for_tests(base, patched):
        yield trees[patched]

    return checkout_for_tests


@pytest.mark.parametrize("pristine_passes", [False, True], ids=["same", "differs"])
def test_part_reruns_what_fails_patched_on_the_pristine_tree(
    tmp_path, monkeypatch, pristine_passes
):
    listing = tmp_path / "neighbours.txt"
    listing.write_text("tests/a/test_x.py\ntests/b/test_gone.py\n")
    monkeypatch.setattr(neighbours, "LIST", listing)
    fake = fake_checkouts(tmp_path, pristine_passes)
    monkeypatch.setattr(sourcetree, "checkout_for_tests", fake)
    monkeypatch.setattr(sourcetree, "checkout_env", lambda *a: dict(os.environ))
    monkeypatch.setattr(sourcetree, "cpu_host_plugin", lambda env: [])
    part = Part("neighbours")
    part.log = tmp_path / "part.log"
    part.log.write_text("")

    neighbours.run_part(part, Path(sys.executable), bases.get_base())

    log = part.log.read_text()
    assert "note: not in vLLM" in log
    pristine = "1 passed" if pristine_passes else "1 failed"
    assert f"pristine, what does not pass patched: {pristine}\n" in log
    if pristine_passes:
        assert (part.passed, part.failed) == (1, 1)
        assert part.problems == [
            "outcome differs: a/test_x.py::test_b: passed pristine, failed patched"
        ]
    else:
        assert (part.passed, part.failed, part.problems) == (1, 0, [])


def test_ci_impact_names_the_steps_that_run_the_series_tests(primary_base):
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "patchset"), "ci-impact"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    glm = [r for r in rows if "(models_basic.yaml)" in r and "GLM5Next" in r]
    assert glm and "vllm/models/glm5next/" in glm[0] and glm[0].endswith(" files |")
    assert f"vLLM {primary_base.version}: the series touches" in done.stdout
