# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The maintainer's edit loop amid the user's own git state: operations in
progress, conflict markers, untracked files, interrupts, other worktrees."""

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from projectkit import INIT, PROBE, Project, git
from test_checkout import checkout  # noqa: F401 (fixture)

from patchset_tool import gitutil


def series_files(project: Project) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(project.patches().iterdir())}


def overlay_files(project: Project) -> dict[str, bytes]:
    return {
        str(p.relative_to(project.overlay())): p.read_bytes()
        for p in sorted(project.overlay().rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A two-commit repository with a side branch that conflicts."""
    repo = tmp_path / "tiny"
    repo.mkdir()
    git("init", "--quiet", "-b", "main", cwd=repo)
    (repo / "f").write_text("one\n")
    git("add", "f", cwd=repo)
    git("commit", "--quiet", "-m", "one", cwd=repo)
    git("checkout", "--quiet", "-b", "side", cwd=repo)
    (repo / "f").write_text("side\n")
    git("commit", "--quiet", "-am", "side", cwd=repo)
    git("checkout", "--quiet", "main", cwd=repo)
    (repo / "f").write_text("two\n")
    git("commit", "--quiet", "-am", "two", cwd=repo)
    return repo


def start(repo: Path, *args: str) -> None:
    """Run a git command expected to stop (conflict, `edit`)."""
    env = {**os.environ, "GIT_EDITOR": "true"}
    env["GIT_SEQUENCE_EDITOR"] = "sed -i 's/^pick/edit/'"
    subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True)


@pytest.mark.parametrize(
    "command, named",
    [
        (["rebase", "-i", "HEAD~1"], "a rebase"),
        (["rebase", "side"], "a rebase"),
        (["merge", "side"], "a merge"),
        (["cherry-pick", "side"], "a cherry-pick"),
        (["revert", "--no-edit", "HEAD"], None),
        (["bisect", "start"], "a bisect"),
        (["stash", "pop"], "unresolved conflicts"),
        (["am", "PATCH"], "a `git am`"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_every_git_operation_in_progress_is_named(
    tiny: Path, command: list[str], named: str | None
) -> None:
    assert gitutil.operation_in_progress(tiny) is None
    if command[0] == "stash":
        (tiny / "f").write_text("stashed\n")
        git("stash", cwd=tiny)
        git("commit", "--quiet", "--allow-empty", "-m", "three", cwd=tiny)
        (tiny / "f").write_text("three\n")
        git("commit", "--quiet", "-am", "three", cwd=tiny)
    if command[0] == "revert":
        (tiny / "f").write_text("three\n")
        git("commit", "--quiet", "-am", "three", cwd=tiny)
        command = ["revert", "--no-edit", "HEAD~1"]
        named = "a revert"
    if command[0] == "am":
        patch = git("format-patch", "-1", "side", "-o", str(tiny.parent), cwd=tiny)
        command = ["am", "-3", patch.strip()]
    start(tiny, *command)
    found = gitutil.operation_in_progress(tiny)
    assert found is not None and named is not None, found
    assert named in found, found
    if command[0] != "bisect":
        assert gitutil.operation_in_progress(tiny, allow_bisect=True) is not None
    else:
        assert gitutil.operation_in_progress(tiny, allow_bisect=True) is None


def stop_rebase_at_patch_1(tree: Path) -> None:
    """The user's `git rebase -i patchset-base`, stopped to edit patch 1."""
    start(tree, "rebase", "-i", "patchset-base")
    assert (tree / ".git" / "rebase-merge").is_dir()


def test_refresh_and_worktree_refuse_amid_the_users_git_operations(
    project: Project,
    work: Path,  # noqa: F811
) -> None:
    """An interactive rebase stopped at patch 1, then an unresolved
    cherry-pick: the harm was conflict markers folded into patch 1 (and the
    overlay) with exit 0, or the user's rebase aborted and their edit lost."""
    before, overlay = series_files(project), overlay_files(project)
    stop_rebase_at_patch_1(work)
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "43"))
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "middle of a rebase" in result.stderr
    assert "Traceback" not in result.stderr
    again = project.patchset("worktree", "--dest", str(work))
    assert again.returncode == 1 and "middle of a rebase" in again.stderr
    assert (work / ".git" / "rebase-merge").is_dir()  # the user's, left alone
    assert "ANSWER = 43" in (work / PROBE).read_text()
    git("checkout", "--quiet", "--", PROBE, cwd=work)
    git("rebase", "--abort", cwd=work)

    git("checkout", "--quiet", "-b", "other", "HEAD~1", cwd=work)
    (work / INIT).write_text((work / INIT).read_text() + "# elsewhere\n")
    git("commit", "--quiet", "-am", "elsewhere", cwd=work)
    git("checkout", "--quiet", "-", cwd=work)
    start(work, "cherry-pick", "other")
    assert "<<<<<<<" in (work / INIT).read_text()
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "middle of a cherry-pick" in result.stderr
    # Staged (conflict "resolved" with the markers in) and the state gone:
    git("add", INIT, cwd=work)
    git("cherry-pick", "--quit", cwd=work)
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"conflict markers in {INIT}" in result.stderr
    assert series_files(project) == before and overlay_files(project) == overlay
    assert project.patchset("check").returncode == 0


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_refresh_changes_nothing_then_folds_tracked_edits_only(
    project: Project,
    work: Path,  # noqa: F811
) -> None:
    """Ctrl-C while the edits are folded (a pre-rebase hook sends it)."""
    before, overlay = series_files(project), overlay_files(project)
    head = git("rev-parse", "HEAD", cwd=work)
    hooks = work.parent / "hooks"
    hooks.mkdir()
    (hooks / "pre-rebase").write_text("#!/bin/sh\nkill -INT 0\nsleep 5\n")
    (hooks / "pre-rebase").chmod(0o755)
    env = {**project.env, "GIT_CONFIG_COUNT": "1"}
    env.update(GIT_CONFIG_KEY_0="core.hooksPath", GIT_CONFIG_VALUE_0=str(hooks))
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "43"))
    result = subprocess.run(
        [sys.executable, str(project.root / "scripts" / "patchset")]
        + ["refresh", "1", "--vllm-src", str(work)],
        cwd=project.root,
        env=env,
        capture_output=True,
        text=True,
        start_new_session=True,  # the signal reaches this run only
        # Ctrl-C as in a terminal, whatever this worker's parent ignores
        # (Python keeps SIGINT ignored when it starts with it ignored).
        preexec_fn=_default_sigint,
    )
    assert result.returncode in (130, -signal.SIGINT), result.stderr
    assert git("rev-parse", "HEAD", cwd=work) == head
    assert not (work / ".git" / "rebase-merge").exists()
    assert git("worktree", "list", "--porcelain", cwd=work).count("worktree ") == 1
    assert "ANSWER = 43" in (work / PROBE).read_text()
    assert series_files(project) == before and overlay_files(project) == overlay

    # Then, not interrupted: tracked edits are folded, untracked files not.
    (work / "notes.txt").write_text("my notes\n")
    (work / (PROBE + ".orig")).write_text("ANSWER = 42\n")
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert result.returncode == 0, result.stderr
    assert "notes.txt" in result.stdout and "not folded" in result.stdout
    text = "".join(series_files(project).values())
    assert "+ANSWER = 43" in text
    assert "notes.txt" not in text and ".orig" not in text
    assert not (project.overlay() / "notes.txt").exists()
    assert (project.overlay() / PROBE).read_text().endswith("ANSWER = 43\n")
    assert (work / "notes.txt").read_text() == "my notes\n"  # left alone
    assert git("status", "--porcelain", "--untracked-files=no", cwd=work) == ""
    assert project.patchset("check").returncode == 0


def test_refresh_next_needs_a_commit_then_makes_it_a_patch(
    project: Project,
    work: Path,  # noqa: F811
) -> None:
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "44"))
    before = series_files(project)
    result = project.patchset("refresh", "3", "--vllm-src", str(work))
    assert result.returncode == 1
    assert "there is none" in result.stderr and "git commit" in result.stderr
    assert "Fold each" not in result.stderr
    assert "for one commit that is a new patch" not in result.stderr
    assert series_files(project) == before

    git("commit", "--quiet", "-am", "[Model] Change the probe's answer", cwd=work)
    (work / INIT).write_text((work / INIT).read_text() + "# folded too\n")
    result = project.patchset("refresh", "3", "--vllm-src", str(work))
    assert result.returncode == 0, result.stderr
    new = sorted(project.patches().glob("0003-*.patch"))
    assert len(new) == 1 and "+# folded too" in new[0].read_text()
    assert new[0].name in project.series_file().read_text()
    assert (project.overlay() / INIT).read_text().endswith("# folded too\n")


def test_apply_check_keeps_the_users_other_worktrees(
    project: Project,
    checkout: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`git worktree prune` would unregister a worktree whose folder is
    away (an unmounted disk); the tool removes only the one it made."""
    other = tmp_path / "other-wt"
    git("worktree", "add", "--quiet", str(other), "HEAD", cwd=checkout)
    other.rename(tmp_path / "away")
    result = project.patchset("apply", "--check", "--vllm-src", str(checkout))
    assert result.returncode == 0, result.stderr
    listed = git("worktree", "list", "--porcelain", cwd=checkout)
    assert f"worktree {other}" in listed
    assert listed.count("worktree ") == 2


def test_worktree_dest_relative_with_a_folder(
    project: Project,
    series: Path,
    history: Path,
) -> None:
    result = project.patchset("worktree", "--dest", "sub/wt")
    assert result.returncode == 0, result.stderr
    assert (project.root / "sub" / "wt" / ".git").is_dir()
    assert sorted(p.name for p in (project.root / "sub").iterdir()) == [
        ".wt.lock",
        "wt",
    ]


@pytest.mark.parametrize(
    "tag, after, base, version",
    [
        ("v0.34.0", 0, "0.34.0", None),
        ("v0.34.0", 12, "0.34.0", None),
        ("v0.33.0", 0, "0.34.0", "0.33.0"),
        ("v0.35.0rc1", 0, "0.34.0", "0.35.0rc1"),
        ("v0.33.0", 3, "0.34.0", "0.33.1.dev3"),
        ("v0.34.0", 3, "0.33.0", "0.34.1.dev3"),
    ],
)
def test_a_checkout_of_another_release_is_named(
    tiny: Path, tag: str, after: int, base: str, version: str | None
) -> None:
    from patchset_tool import bases

    git("tag", tag, cwd=tiny)
    for n in range(after):
        git("commit", "--quiet", "--allow-empty", "-m", f"{n}", cwd=tiny)
    why = gitutil.other_release(tiny, bases.get_base(base))
    assert (why is None) == (version is None), why
    if version:
        assert f"is vLLM {version} (git describe: {tag}" in str(why)


def test_a_stray_version_file_never_decides_the_release(tiny: Path) -> None:
    """An untracked vllm/_version.py left by a build of another commit:
    apply, export and bisect-run all go by the tag."""
    from patchset_tool import bases

    git("tag", "v0.34.0", cwd=tiny)
    (tiny / "vllm").mkdir()
    (tiny / "vllm" / "_version.py").write_text("__version__ = version = '0.33.0'\n")
    assert gitutil.other_release(tiny, bases.get_base("0.34.0")) is None
    assert gitutil.other_release(tiny, bases.get_base("0.33.0")) is not None
    release = gitutil.release_of(tiny)
    assert release is not None and release.version == "0.34.0"


def test_apply_refuses_a_checkout_of_another_release(
    project: Project,
    checkout: Path,  # noqa: F811
) -> None:
    git("tag", "v0.1.0", cwd=checkout)
    before = git("rev-parse", "HEAD", cwd=checkout)
    result = project.patchset("apply", "--vllm-src", str(checkout))
    assert result.returncode == 1
    assert "is vLLM 0.1.0 (git describe: v0.1.0)" in result.stderr
    assert git("rev-parse", "HEAD", cwd=checkout) == before
    forced = project.patchset(
        "apply", "--check", "--other-release", "--vllm-src", str(checkout)
    )
    assert forced.returncode == 0, forced.stderr
    assert "--other-release" in forced.stdout


def test_a_result_is_published_from_a_worker_thread(tmp_path: Path) -> None:
    """`test` applies the series to release checkouts from its worker
    threads, where Python refuses to set a signal handler."""

    def publish() -> int:
        with gitutil.publishing("nothing"):
            return gitutil.git("--version", cwd=tmp_path).returncode

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(publish).result() == 0
