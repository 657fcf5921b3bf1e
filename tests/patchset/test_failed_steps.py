# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A step that fails after the tool began to write (a hook refusing the
ref update, a full or read-only filesystem) leaves the user's checkout and
the series as they were, and says so; the user's git configuration and a
relative TMPDIR change nothing the tool reads or writes."""

import hashlib
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from projectkit import (
    PROBE,
    REPO,
    SPDX,
    Project,
    git,
    in_mount_namespace,
    needs_unshare,
    write_series,
)
from test_bases import NEW, ported, with_history  # noqa: F401
from test_export import exporter_env, make_checkout, written  # noqa: F401

REFUSE = """#!/bin/sh
[ "$1" = prepared ] || { cat >/dev/null; exit 0; }
if grep -q ' refs/heads/'; then echo "hook: refused" >&2; exit 1; fi
"""


def state(repo: Path) -> tuple[str, str, str, list[str]]:
    """HEAD, its branch, every file's status and the files on disk."""
    files = sorted(
        str(p.relative_to(repo)) for p in repo.rglob("*") if ".git" not in p.parts
    )
    return (
        git("rev-parse", "HEAD", cwd=repo),
        git("symbolic-ref", "-q", "HEAD", cwd=repo),
        git("status", "--porcelain", "--untracked-files=all", cwd=repo),
        files,
    )


def contents(*folders: Path) -> dict[str, bytes]:
    return {
        str(p): p.read_bytes() for f in folders for p in f.rglob("*") if p.is_file()
    }


def one_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    return result.stderr


# --- a failing last step into the user's checkout ---------------------------------


def test_a_hook_refusing_the_ref_update_leaves_the_checkout_as_it_was(
    project: Project, series: Path, tmp_path: Path
) -> None:
    checkout = make_checkout(series, tmp_path)
    hook = checkout / ".git" / "hooks" / "reference-transaction"
    hook.write_text(REFUSE)
    hook.chmod(0o755)
    before = state(checkout)
    result = project.patchset("apply", "--vllm-src", str(checkout))
    line = one_error(result)
    assert "could not put the series' commits on" in line
    assert "everything is as it was" in line
    assert state(checkout) == before


def test_refresh_with_its_branch_update_refused_changes_nothing(
    project: Project, work: Path
) -> None:
    hook = work / ".git" / "hooks" / "reference-transaction"
    hook.write_text(REFUSE)
    hook.chmod(0o755)
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "43"))
    before = (state(work), contents(project.patches(), project.overlay()))
    stamp = (work / ".git" / "patchset-series").read_bytes()
    result = project.patchset("refresh", "1", "--vllm-src", str(work))
    assert "everything is as it was" in one_error(result)
    assert (state(work), contents(project.patches(), project.overlay())) == before
    assert (work / ".git" / "patchset-series").read_bytes() == stamp


@needs_unshare
def test_apply_onto_a_checkout_on_a_full_filesystem(
    project: Project, pristine_site: Path, tmp_path: Path
) -> None:
    """The series adds a file too big for what is left (its object, well
    compressed, fits): the step that writes the checkout's files fails."""
    big = [("[Model] Add a big table", {PROBE: lambda _: SPDX + "X = 1\n" * 200_000})]
    repo = write_series(project, pristine_site, big, tmp_path / "big")
    small = tmp_path / "small"
    small.mkdir()
    script = (
        f"mount -t tmpfs -o size=512k tmpfs {small} && "
        f"git clone -qn {repo} {small}/co && git -C {small}/co reset -q --hard base"
        f" && git -C {small}/co status --porcelain --untracked-files=all && "
        f"git -C {small}/co rev-parse HEAD && echo BEFORE && "
        f"{sys.executable} scripts/patchset apply --vllm-src {small}/co; "
        f"echo AFTER; git -C {small}/co status --porcelain --untracked-files=all; "
        f"git -C {small}/co rev-parse HEAD; ls -A {small}/co"
    )
    result = in_mount_namespace(script, project.root, project.env)
    before, _, after = result.stdout.partition("BEFORE\n")
    assert "unable to write file" in result.stderr, result.stderr
    assert "everything is as it was" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert after.removeprefix("AFTER\n").startswith(before), after


@needs_unshare
@pytest.mark.parametrize(
    "spoil",
    [
        "mount --bind {o} {o} && mount -o remount,ro,bind {o}",
        (
            "mount -t tmpfs -o size=64k tmpfs {o} && cp -r {k}/. {o}"
            " && (dd if=/dev/zero of={o}/fill bs=4k 2>/dev/null; true)"
        ),
    ],
    ids=["read-only", "full"],
)
def test_refresh_that_cannot_write_the_overlay_rewrites_no_patch(
    project: Project, work: Path, tmp_path: Path, spoil: str
) -> None:
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "43"))
    patches = contents(project.patches())
    kept = tmp_path / "kept"
    subprocess.run(["cp", "-r", str(project.overlay()), str(kept)], check=True)
    script = (
        spoil.format(o=project.overlay(), k=kept)
        + f" && {sys.executable} scripts/patchset refresh 1 --vllm-src {work}"
    )
    head = git("rev-parse", "HEAD", cwd=work)
    result = in_mount_namespace(script, project.root, project.env)
    assert "everything is as it was" in one_error(result)
    assert contents(project.patches()) == patches
    assert git("rev-parse", "HEAD", cwd=work) == head
    assert "ANSWER = 43" in (work / PROBE).read_text(), "the edit is kept"


# --- the series stamp is part of refresh's publish step --------------------------

KILL_ON_BRANCH = """#!/bin/sh
[ "$1" = committed ] || { cat >/dev/null; exit 0; }
grep -q ' refs/heads/' && kill -TERM "$TARGET" && sleep 0.3
exit 0
"""


def test_a_signal_while_refresh_publishes_still_records_the_series(
    project: Project, work: Path
) -> None:
    hook = work / ".git" / "hooks" / "reference-transaction"
    hook.write_text(KILL_ON_BRANCH)
    hook.chmod(0o755)
    (work / PROBE).write_text((work / PROBE).read_text().replace("42", "43"))
    result = subprocess.run(
        ["sh", "-c", 'TARGET=$$ exec "$@"', "sh", sys.executable]
        + [str(project.root / "scripts" / "patchset"), "refresh", "1"]
        + ["--vllm-src", str(work)],
        cwd=project.root,
        env=project.env,
        capture_output=True,
        text=True,
        start_new_session=True,
    )
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "after it had put the refreshed series" in result.stderr
    digest = hashlib.sha256()
    for name in project.series_file().read_text().split():
        digest.update(name.encode() + b"\0")
        digest.update((project.patches() / name).read_bytes() + b"\0")
    assert (work / ".git" / "patchset-series").read_text() == digest.hexdigest() + "\n"
    hook.unlink()
    again = project.patchset("worktree", "--dest", str(work))
    assert again.returncode == 0, again.stderr


# --- rebase --onto: interrupted, and a work tree that is not the port ------------

KILL_MID_REBASE = """#!/bin/sh
[ -d "$(git rev-parse --git-path rebase-merge)" ] && kill -TERM -"$TARGET"
sleep 0.3
exit 0
"""


def test_an_interrupted_rebase_leaves_no_work_tree(
    ported: Project,  # noqa: F811
    tmp_path: Path,
) -> None:
    with_history(ported, tmp_path, new_x05="x05 = 5")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "post-checkout").write_text(KILL_MID_REBASE)
    (hooks / "post-checkout").chmod(0o755)
    env = {**ported.env, "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.hooksPath"}
    env["GIT_CONFIG_VALUE_0"] = str(hooks)
    result = subprocess.run(
        ["sh", "-c", 'TARGET=$$ exec "$@"', "sh", sys.executable]
        + [str(ported.root / "scripts" / "patchset"), "rebase", "--onto", NEW],
        cwd=ported.root,
        env=env,
        capture_output=True,
        text=True,
        start_new_session=True,
    )
    assert result.returncode == 128 + signal.SIGTERM, result.stderr
    assert "nothing partial was left in place" in result.stderr
    left = [p.name for p in ported.build(NEW).iterdir()]
    assert [n for n in left if not n.endswith(".lock")] == [], left


@pytest.mark.parametrize(
    "spoil, words",
    [
        (["reset", "--quiet", "--hard", "ORIG_HEAD"], "does not descend from"),
        (["commit", "--quiet", "--allow-empty", "-m", "wip"], "not one commit per"),
    ],
    ids=["un-rebased", "extra-commit"],
)
def test_refresh_refuses_a_work_tree_that_is_not_the_port(
    ported: Project,  # noqa: F811
    tmp_path: Path,
    spoil: list[str],
    words: str,
) -> None:
    """Un-rebased: the rebase's ORIG_HEAD, the series on the older release."""
    with_history(ported, tmp_path, new_x05="x05 = 5")
    assert ported.patchset("rebase", "--onto", NEW).returncode == 0
    work = ported.build(NEW) / "work"
    git(*spoil, cwd=work)
    result = ported.patchset("refresh", "1", "--base", NEW)
    assert words in one_error(result)
    assert not ported.patches(NEW).exists() or not any(ported.patches(NEW).iterdir())


# --- the user's git configuration, a relative TMPDIR ------------------------------


@pytest.fixture
def hostile(project: Project, tmp_path: Path) -> dict[str, str]:
    """A global git configuration that colours, pages, diffs externally
    and drops the a/ b/ prefixes."""
    external = tmp_path / "external-diff"
    external.write_text("#!/bin/sh\necho EXTERNAL DIFF\n")
    external.chmod(0o755)
    config = tmp_path / "gitconfig"
    config.write_text(
        "[color]\n\tui = always\n\tdiff = always\n"
        f"[diff]\n\texternal = {external}\n\tnoprefix = true\n"
        "[core]\n\tpager = false\n[pager]\n\tdiff = true\n"
        "[alias]\n\tdiff = log\n\tlog = status\n"
        "[format]\n\tsignOff = true\n"
    )
    return {**project.env, "GIT_CONFIG_GLOBAL": str(config)}


def test_refresh_reads_git_as_git_whatever_the_users_configuration(
    project: Project, work: Path, hostile: dict[str, str]
) -> None:
    probe = work / PROBE
    good = probe.read_text()
    probe.write_text(good + "<<<<<<< ours\nA = 1\n=======\nA = 2\n>>>>>>> theirs\n")
    result = project.patchset("refresh", "1", "--vllm-src", str(work), env=hostile)
    assert "conflict markers in" in one_error(result)
    probe.write_text(good.replace("42", "43"))
    result = project.patchset("refresh", "1", "--vllm-src", str(work), env=hostile)
    assert result.returncode == 0, result.stderr
    patch = sorted(project.patches().glob("0001-*.patch"))[0].read_text()
    assert "\x1b[" not in patch and f"+++ b/{PROBE}" in patch
    assert "EXTERNAL" not in patch
    checked = project.patchset("check", env=hostile)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("command", ["apply --check", "export"])
def test_a_relative_tmpdir_writes_nothing_into_the_checkout(
    project: Project, series: Path, tmp_path: Path, command: str
) -> None:
    checkout = make_checkout(series, tmp_path)
    env = {**exporter_env(project, tmp_path / "home"), "TMPDIR": "."}
    args = command.split() + ["--vllm-src", str(checkout)]
    if command == "export":
        args += ["--pr-dir", str(tmp_path / "pr")]
    result = project.patchset(*args, env=env)
    assert result.returncode == 0, result.stderr
    assert git("status", "--porcelain", "--untracked-files=all", cwd=checkout) == ""
    assert not list(project.root.glob("patchset-*")), "scratch left behind"


# --- removing a scratch folder, writing a GPU stage: whole, whatever comes ---------

IN_PROCESS = """
import os, shutil, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from patchset_tool import gitutil
case, where = sys.argv[2], Path(sys.argv[3])
real = shutil.rmtree


def interrupted(path, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    real(path, *args, **kwargs)


def write(new, fault):
    new.mkdir()
    (new / "part1").write_text("new")
    raise fault


try:
    if case == "scratch-clone":
        shutil.rmtree = interrupted
        with gitutil.scratch_clone(where) as clone:
            print(clone.parent, flush=True)
    else:
        fault = OSError(28, "full") if case == "stage-fails" else KeyboardInterrupt()
        gitutil.publish_folder(where, lambda new: write(new, fault))
except (KeyboardInterrupt, OSError) as exc:
    print("stopped:", type(exc).__name__)
"""


@pytest.mark.parametrize("case", ["scratch-clone", "stage-interrupted", "stage-fails"])
def test_a_signal_or_a_fault_leaves_no_part_of_a_folder(
    series: Path, tmp_path: Path, case: str
) -> None:
    stage = tmp_path / "build" / "gpu" / "stage"
    stage.mkdir(parents=True)
    (stage / "part1").write_text("old")
    where = series if case == "scratch-clone" else stage
    result = subprocess.run(
        [sys.executable, "-c", IN_PROCESS, str(REPO / "scripts"), case, str(where)],
        capture_output=True,
        text=True,
    )
    assert "stopped:" in result.stdout, result.stdout + result.stderr
    if case == "scratch-clone":
        assert not Path(result.stdout.splitlines()[0]).exists(), "scratch left"
    assert (stage / "part1").read_text() == "old"
    left = [p.name for p in stage.parent.iterdir() if not p.name.endswith(".lock")]
    assert left == ["stage"]
