# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Interrupts of the commands that work on a user's checkout: whatever the
moment, and whether the signal goes to the process group (Ctrl-C, a closed
terminal, `timeout`) or to the tool alone (`kill PID`), the checkout is
left as it was or with the command's whole result, and the message says
which. A git hook sends the signal at its Nth call, N spread over a run."""

import hashlib
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from projectkit import PROBE, Project, build_history, git
from test_export import exporter_env, make_checkout, written  # noqa: F401

HOOK = """#!/bin/sh
case "$1" in prepared|committed|aborted) cat >/dev/null;; esac
n=$(( $(cat "$AT_FILE" 2>/dev/null || echo 0) + 1 ))
echo $n >"$AT_FILE"
[ "$n" = "$AT" ] && kill -"$SIG" "$TARGET" && sleep 0.3
exit 0
"""
HOOKS = ("reference-transaction", "post-checkout", "pre-applypatch")
HOOKS += ("post-applypatch", "post-merge", "post-rewrite")
WAYS = ["INT group", "TERM tool", "HUP group", "TERM group"]
"""The signal and its target at the 1st, 2nd, ... moment tried."""


def snapshot(root: Path, repo: Path) -> dict[str, object]:
    """What an interrupt could leave half done: every path under `root`
    outside `repo` (with a file's bytes), and of the git `repo`: its refs
    and HEAD (by tree and subject: commit ids carry the time), its work
    tree's status, and any lock, operation state or registered worktree."""
    outside = {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
        if not p.is_relative_to(repo)
        and not p.name.endswith(".lock")
        and "__pycache__" not in p.parts
    }
    if not (repo / ".git").exists():
        return {"outside": outside}
    gitdir = repo / ".git"
    return {
        "outside": outside,
        "refs": git("for-each-ref", "--format=%(refname) %(tree) %(subject)", cwd=repo),
        "head": git("log", "-4", "--format=%T %s", cwd=repo),
        "branch": git("branch", "--show-current", cwd=repo),
        "status": git("status", "--porcelain", "--untracked-files=all", cwd=repo),
        "git": sorted(
            str(p.relative_to(gitdir))
            for p in gitdir.rglob("*")
            if p.name.endswith(".lock")
            or p.name in ("rebase-apply", "rebase-merge", "worktrees", "MERGE_HEAD")
        ),
    }


def run(
    project: Project, env: dict[str, str], argv: list[str], tmp: Path, at: int, way: str
) -> subprocess.CompletedProcess[str]:
    """The tool, with the hooks sending signal `way` ("INT group": to the
    process group; "TERM tool": to the tool alone) at their `at`th call."""
    hooks, counter, scratch = tmp / "hooks", tmp / "count", tmp / "tmp"
    hooks.mkdir(exist_ok=True)
    scratch.mkdir(exist_ok=True)
    for name in HOOKS:
        (hooks / name).write_text(HOOK)
        (hooks / name).chmod(0o755)
    counter.unlink(missing_ok=True)
    sig, target = way.split()
    env = {**env, "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.hooksPath"}
    env.update(GIT_CONFIG_VALUE_0=str(hooks), AT_FILE=str(counter), AT=str(at))
    env.update(SIG=sig, WHO="-" if target == "group" else "", TMPDIR=str(scratch))
    proc = subprocess.run(
        # sh execs the tool: its pid ($$) is the tool's, and leads its group
        ["sh", "-c", 'TARGET=$WHO$$ exec "$@"', "sh", sys.executable]
        + [str(project.root / "scripts" / "patchset"), *argv],
        cwd=project.root,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        start_new_session=True,  # a group of its own: no signal reaches pytest
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        timeout=120,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not list(scratch.iterdir()), "scratch left in TMPDIR"
    return proc


def check_every_moment(
    prepare: Callable[[Path], tuple[list[str], Path, Path]],
    project: Project,
    env: dict[str, str],
    tmp: Path,
) -> None:
    """Run the command `prepare(folder)` gives (argv, the checkout it
    changes, the folder it writes in) once whole, counting the hooks'
    calls, then interrupted at moments spread over them, each prepared
    afresh; each leaves all as before or as the whole run left it, and
    says which."""
    argv, repo, root = prepare(tmp / "whole")
    before = snapshot(root, repo)
    whole = run(project, env, argv, tmp, 0, WAYS[0])
    assert whole.returncode == 0, whole.stderr
    after = snapshot(root, repo)
    calls = int((tmp / "count").read_text())
    moments = sorted({max(1, calls // 4), calls // 2, calls - 1, calls})
    for at, way in zip(moments, WAYS):
        folder = tmp / f"at-{at}"
        argv, repo, root = prepare(folder)
        result = run(project, env, argv, tmp, at, way)
        where = f"{way} at hook call {at} of {calls}: {result.stderr}"
        signum = signal.Signals["SIG" + way.split()[0]]
        assert result.returncode == 128 + signum, where
        got = snapshot(root, repo)
        if got == before:
            assert "nothing partial was left in place" in result.stderr, where
        else:
            assert got == after, where
            assert "after it had put" in result.stderr, where


def checkout_at_base(series: Path, folder: Path) -> Path:
    """A clone of the repository the patches came from, at their base."""
    folder.mkdir(parents=True)
    git("clone", "--quiet", str(series), str(folder / "vllm"), cwd=folder)
    git("reset", "--quiet", "--hard", "base", cwd=folder / "vllm")
    return folder / "vllm"


@pytest.mark.parametrize("check", [False, True], ids=["apply", "apply-check"])
def test_apply_to_a_checkout_interrupted_at_any_moment(
    project: Project, series: Path, tmp_path: Path, check: bool
) -> None:
    def prepare(folder: Path) -> tuple[list[str], Path, Path]:
        repo = checkout_at_base(series, folder)
        argv = ["apply", *(["--check"] if check else []), "--vllm-src", str(repo)]
        return argv, repo, folder

    check_every_moment(prepare, project, project.env, tmp_path)


def test_export_interrupted_at_any_moment(
    project: Project, series: Path, tmp_path: Path
) -> None:
    def prepare(folder: Path) -> tuple[list[str], Path, Path]:
        folder.mkdir(parents=True)
        repo = make_checkout(series, folder)
        argv = ["export", "--vllm-src", str(repo), "--pr-dir", str(folder / "pr")]
        return argv, repo, folder

    env = exporter_env(project, tmp_path / "home")
    check_every_moment(prepare, project, env, tmp_path)


def test_refresh_interrupted_at_any_moment(
    project: Project, series: Path, tmp_path: Path
) -> None:
    """Refresh folds an edit into patch 1 of a checkout of the user's
    (its commits, patches/ and the overlay change)."""
    kept = tmp_path / "kept"
    shutil.copytree(project.root / "patches", kept / "patches")
    shutil.copytree(project.root / "vllm_overlay", kept / "vllm_overlay")

    def prepare(folder: Path) -> tuple[list[str], Path, Path]:
        for name in ("patches", "vllm_overlay"):
            shutil.rmtree(project.root / name)
            shutil.copytree(kept / name, project.root / name)
        folder.mkdir(parents=True)
        repo = folder / "vllm"
        git("clone", "--quiet", str(series), str(repo), cwd=folder)
        git("tag", "patchset-base", "base", cwd=repo)
        digest = hashlib.sha256()  # the series it holds, as `worktree` records it
        for name in (project.series_file()).read_text().split():
            digest.update(name.encode() + b"\0")
            digest.update((project.patches() / name).read_bytes() + b"\0")
        (repo / ".git" / "patchset-series").write_text(digest.hexdigest() + "\n")
        (repo / PROBE).write_text((repo / PROBE).read_text().replace("42", "43"))
        return ["refresh", "1", "--vllm-src", str(repo)], repo, project.root

    check_every_moment(prepare, project, project.env, tmp_path)


def test_worktree_interrupted_at_any_moment(
    project: Project, series: Path, tmp_path: Path
) -> None:
    """The release history holds only the files the series touches."""
    release = tmp_path / "release"
    git("clone", "--quiet", "--branch", "base", str(series), str(release), cwd=tmp_path)
    shutil.rmtree(release / ".git")
    history = project.cache / "src" / f"vllm-history-{project.version}"
    build_history(history, [(project.version, release)])

    def prepare(folder: Path) -> tuple[list[str], Path, Path]:
        folder.mkdir(parents=True)
        return ["worktree", "--dest", str(folder / "work")], folder / "work", folder

    check_every_moment(prepare, project, project.env, tmp_path)
