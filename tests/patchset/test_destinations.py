# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tool replaces only what it made: never an installation, a folder of
the user's, or a tree another run is writing; and it knows a damaged tree."""

import os
import stat
import subprocess
from pathlib import Path

import pytest
from projectkit import PROBE, Project

from patchset_tool import trees, wheel


def fake_site(tmp_path: Path) -> Path:
    """A site-packages holding a package and its dist-info."""
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("installed = True\n")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("torch = True\n")
    (site / "vllm-9.9.9.dist-info").mkdir()
    (site / "vllm-9.9.9.dist-info" / "RECORD").write_text("")
    return site


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_refused(result: subprocess.CompletedProcess[str], path: Path) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and "nothing was changed" in lines[0]


@pytest.mark.parametrize("where", ["site-packages/vllm", "site-packages"])
def test_apply_refuses_an_installation(
    project: Project, series: Path, tmp_path: Path, where: str
) -> None:
    site = fake_site(tmp_path)
    before = snapshot(site.parent)
    dest = site / "vllm" if where.endswith("vllm") else site
    result = project.patchset("apply", "--dest", str(dest))
    assert_refused(result, dest)
    assert snapshot(site.parent) == before
    assert [p.name for p in site.parent.iterdir()] == ["site-packages"]


def test_apply_refuses_a_pip_target_folder(
    project: Project, series: Path, tmp_path: Path
) -> None:
    """`pip install --target DIR`: no site-packages in the path, but the
    folder holds an installed package."""
    target = tmp_path / "target"
    (target / "vllm").mkdir(parents=True)
    (target / "vllm" / "_version.py").write_text("__version__ = '9.9.9'\n")
    (target / "vllm-9.9.9.dist-info").mkdir()
    before = snapshot(target)
    for dest in (target / "vllm", target, target / "new"):
        result = project.patchset("apply", "--dest", str(dest))
        assert_refused(result, dest)
    assert snapshot(target) == before
    assert sorted(p.name for p in target.iterdir()) == ["vllm", "vllm-9.9.9.dist-info"]


def test_apply_refuses_a_folder_of_the_users(
    project: Project, series: Path, tmp_path: Path
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    result = project.patchset("apply", "--dest", str(mine))
    assert_refused(result, mine)
    assert snapshot(mine) == {"notes.txt": b"keep me\n"}


def test_apply_replaces_its_own_tree_and_an_empty_folder(
    project: Project, series: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    first = project.patchset("apply", "--dest", str(empty))
    assert first.returncode == 0, first.stderr
    again = project.patchset("apply", "--force", "--dest", str(empty))
    assert again.returncode == 0, again.stderr
    assert (empty / PROBE).is_file() and (empty / trees.MARKER).is_file()


def test_worktree_refuses_a_folder_of_the_users(
    project: Project, series: Path, history: Path, tmp_path: Path
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    result = project.patchset("worktree", "--dest", str(mine))
    assert_refused(result, mine)
    assert snapshot(mine) == {"notes.txt": b"keep me\n"}
    site = fake_site(tmp_path)
    result = project.patchset("worktree", "--dest", str(site / "work"))
    assert_refused(result, site / "work")
    assert not (site / "work").exists()


def test_build_refuses_an_installation(project: Project, tmp_path: Path) -> None:
    site = fake_site(tmp_path)
    before = snapshot(site.parent)
    result = project.patchset("build", "--dist", str(site))
    assert_refused(result, site)
    assert snapshot(site.parent) == before


def test_concurrent_forced_applies_leave_a_complete_tree(
    project: Project, series: Path
) -> None:
    """Three `apply --force` at once: each exits 0 and the tree is complete
    (its manifest matches); docs/measurements.md has 20 rounds of pairs."""
    runs = [
        subprocess.Popen(
            ["python3", "scripts/patchset", "apply", "--force"],
            cwd=project.root,
            env=project.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    for run in runs:
        out, err = run.communicate()
        assert run.returncode == 0, out + err
        assert "Traceback" not in err
    assert trees.damage(project.patched) == []
    assert (project.patched / PROBE).is_file()
    leftovers = sorted(p.name for p in project.build().iterdir())
    assert leftovers == [".vllm-patched.lock", "vllm-patched"]


def test_a_tree_with_missing_files_is_named_and_rebuilt(
    project: Project, series: Path
) -> None:
    assert project.patchset("apply").returncode == 0
    victim = project.patched / "vllm" / "version.py"
    assert victim.is_file()
    victim.unlink()
    check = project.patchset("apply", "--check")
    assert check.returncode == 1, check.stdout + check.stderr
    assert "damaged" in check.stdout and "vllm/version.py: missing" in check.stdout
    again = project.patchset("apply")
    assert again.returncode == 0, again.stderr
    assert "already up to date" not in again.stdout
    assert victim.is_file() and trees.damage(project.patched) == []


def test_lock_waits_for_the_holder(tmp_path: Path) -> None:
    """A second writer of the same tree waits, saying so, until the first
    lets go."""
    tree = tmp_path / "tree"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from pathlib import Path; from patchset_tool import trees;"
        "cm = trees.locked(Path(sys.argv[2])); cm.__enter__(); print('held')"
    )
    scripts = str(Path(trees.__file__).parents[1])
    with trees.locked(tree):
        waiter = subprocess.Popen(
            ["python3", "-c", code, scripts, str(tree)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        with pytest.raises(subprocess.TimeoutExpired):
            waiter.wait(timeout=1)
    out, err = waiter.communicate(timeout=30)
    assert out == "held\n"
    assert f"waiting for another patchset run writing {tree}" in err


def test_tree_and_wheel_follow_the_umask(
    project: Project, series: Path, tmp_path: Path
) -> None:
    """A patched tree is 0755 and a wheel 0644 under umask 022, as `cp`
    would make them (mkdtemp and mkstemp alone give 0700 and 0600)."""
    old = os.umask(0o022)
    try:
        assert project.patchset("apply").returncode == 0
        target = tmp_path / "dist" / "some.whl"
        wheel._write_atomically(target, lambda p: p.write_bytes(b"zip"), 3)
    finally:
        os.umask(old)
    assert stat.S_IMODE(project.patched.stat().st_mode) == 0o755
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
