# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Thin wrappers over the git command line: every git the tool runs goes
through `git` here (in the C locale), with the tool's one commit IDENTITY.

A user's checkout is changed by one rule: the work is done in a scratch
clone (`scratch_clone`, which writes nothing into the checkout), and its
result is put in place at the end by `publishing`, with SIGINT, SIGTERM
and SIGHUP held back; a step of it that fails is undone, every undo step
run even when another fails. So an interrupt or a failure leaves the
checkout as it was or the whole result in place, and the message says
which (`PUBLISHED`; the failure's message).

The git output the tool reads is the same whatever the user's git
configuration: no colour, external diff, text conversion, pager or
prefix option reaches it (`NEUTRAL`, `DIFF_FLAGS`)."""

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

from . import trees
from .bases import Base, release_order
from .errors import HELD, PatchsetError, describe_fault, signals_held
from .series import Patch

FAILED_AT = re.compile(r"error: patch failed: (\S+):(\d+)")
AM_FAILED = re.compile(r"Patch failed at (\d{4})")
EXISTS = re.compile(r"error: (\S+): already exists in (?:working directory|index)")
CORRUPT = re.compile(r"(corrupt patch at line \d+)")
TOOL_NAME, TOOL_EMAIL = "patchset", "patchset@localhost"
T = TypeVar("T")
IDENTITY = ("-c", f"user.name={TOOL_NAME}", "-c", f"user.email={TOOL_EMAIL}")
"""git options that make the tool the author of the commits it makes."""


def git_exe() -> str:
    """The git executable; a clear error if there is none on PATH."""
    exe = shutil.which("git")
    if exe is None:
        raise PatchsetError("git is not on PATH; install git (apt-get install git)")
    return exe


def git_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with git's messages in English
    whatever the user's LANG/LANGUAGE: the tool reads them."""
    fixed = dict(os.environ if env is None else env)
    fixed["LC_ALL"] = "C"
    fixed["GIT_OPTIONAL_LOCKS"] = "0"  # a read (status) never takes a lock
    for name in ("LANGUAGE", "GIT_EXTERNAL_DIFF", "GIT_DIFF_OPTS", "GIT_PAGER"):
        fixed.pop(name, None)
    return fixed


SETTINGS = (
    "color.ui=never color.diff=never color.status=never color.branch=never "
    "core.pager=cat diff.noprefix=false diff.mnemonicPrefix=false "
    "diff.relative=false diff.context=3 log.showSignature=false "
    "format.attach= format.signOff=false format.subjectPrefix=PATCH "
    "format.suffix=.patch"
)
NEUTRAL = tuple(arg for setting in SETTINGS.split() for arg in ("-c", setting))
"""Settings of a user's git configuration that would change the output the
tool reads (aliases never replace git's own commands)."""
DIFF_FLAGS = {
    name: ("--no-ext-diff", "--no-textconv", "--no-color")
    for name in ("diff", "diff-tree", "format-patch", "log", "show")
}


PUBLISHED: list[str] = []
"""What `publishing` put in place in this run (for the interrupt message)."""
Undo = list[Callable[[], object]]
"""The steps that put back what a publishing step changed, last first."""


@contextlib.contextmanager
def publishing(what: str) -> Iterator[Undo]:
    """Run the body (the step that puts a command's result in place) with
    SIGINT, SIGTERM and SIGHUP held back (`signals_held`), its git in a
    session of its own (a signal to the process group misses it too). The
    body registers, before each change, how to put it back; if the body
    fails, every one of those steps runs (last first, each even when
    another fails) and the error says whether all is as it was."""
    undo: Undo = []
    with signals_held():
        try:
            yield undo
        except Exception as exc:
            raise _undone(what, exc, undo) from exc
        PUBLISHED.append(what)


def publish_folder(dest: Path, write: Callable[[Path], T]) -> T:
    """`write(folder)` into a staging folder beside `dest`, then put the
    folder in place of `dest` by `publishing`: an interrupt or a failure
    leaves `dest` as it was or whole. Return what `write` returned."""
    with trees.locked(dest), trees.staging(dest) as work:
        trees.remove_stale(dest)  # only the marked staging folders a killed run left
        result = write(work / "new")
        with publishing(str(dest)) as undo:
            if dest.exists():
                dest.rename(work / "old")
                undo.append(partial(os.rename, work / "old", dest))
            (work / "new").rename(dest)
    return result


def git(
    *args: str,
    cwd: Path,
    check: bool = True,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run git in `cwd` (every git the tool runs goes through here, in the
    C locale); raise a PatchsetError with git's message on failure."""
    at = 0
    while args[at] == "-c":  # the command follows any `-c key=value`
        at += 2
    flags = DIFF_FLAGS.get(args[at], ())
    proc = subprocess.run(
        [git_exe(), "--no-pager", *NEUTRAL, *args[: at + 1], *flags, *args[at + 1 :]],
        cwd=cwd,
        text=True,
        input=input,
        capture_output=True,
        env=git_env(env),
        start_new_session=bool(HELD),
    )
    if check and proc.returncode:
        command = f"git {' '.join(args)}"[:200]
        if "No space left on device" in proc.stderr:
            raise PatchsetError(
                f"no space left on the device ({command} in {cwd}); free space "
                "and run again"
            )
        said = proc.stderr.strip().splitlines()
        cut = ["..."] * (len(said) > 20) + said[-20:]
        raise PatchsetError(f"{command} failed in {cwd}:\n" + "\n".join(cut))
    return proc


def _undone(what: str, exc: Exception, undo: Undo) -> PatchsetError:
    """Run every step of `undo`, last first, even when one fails; the
    error that says what failed and whether all is as it was."""
    failed = []
    for step in reversed(undo):
        try:
            step()
        except Exception as broken:  # noqa: BLE001 - the next step still runs
            failed.append(_one_line(broken))
    state = "everything is as it was"
    if failed:
        state = "and putting it back failed too (check it by hand): " + "; ".join(
            failed
        )
    return PatchsetError(f"could not put {what} in place ({_one_line(exc)}); {state}")


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, PatchsetError):
        lines = str(exc).splitlines() or [""]
        return lines[0].rstrip(":") + (f": {lines[-1].strip()}" * (len(lines) > 1))
    return describe_fault(exc)


def working_tree_bytes(repo: Path) -> int:
    """The size of what a copy of `repo`'s working tree holds: its tracked
    files and the untracked ones git does not ignore."""
    listed = git(
        "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=repo
    ).stdout.split("\0")
    return sum(
        (repo / name).stat().st_size for name in listed if (repo / name).is_file()
    )


def outside_repo_env(directory: Path) -> dict[str, str]:
    """Environment in which git does not discover a repository above
    `directory`, so `git apply` behaves like patch(1) there."""
    env = dict(os.environ)
    env["GIT_CEILING_DIRECTORIES"] = str(directory.parent)
    return env


def committer_env(src: Path) -> dict[str, str] | None:
    """None where git knows who commits in `src`; otherwise an environment
    naming the tool as committer (each patch keeps its own author)."""
    if git("config", "user.email", cwd=src, check=False).stdout.strip():
        return None
    return {
        **os.environ,
        "GIT_COMMITTER_NAME": TOOL_NAME,
        "GIT_COMMITTER_EMAIL": TOOL_EMAIL,
    }


def explain_failure(patch: Patch, output: str) -> str:
    """Name the file and hunk at which `patch` failed, from git's output."""
    if match := FAILED_AT.search(output):
        path, line = match.group(1), int(match.group(2))
        diff = patch.file(path)
        hunk = diff.hunk_at(line) if diff else 0
        where = f"hunk #{hunk} (line {line})" if hunk else f"line {line}"
        return f"{patch.name}: {path}: {where} does not apply"
    if match := EXISTS.search(output):
        return f"{patch.name}: creates {match.group(1)}, which already exists"
    if match := CORRUPT.search(output):
        return f"{patch.name}: {match.group(1)}"
    return f"{patch.name}: does not apply"


OPERATIONS = (
    ("rebase-merge", "a rebase (`git rebase`, `-i` or not)", "rebase"),
    ("rebase-apply/applying", "a `git am`", "am"),
    ("rebase-apply", "a rebase", "rebase"),
    ("MERGE_HEAD", "a merge", "merge"),
    ("CHERRY_PICK_HEAD", "a cherry-pick", "cherry-pick"),
    ("REVERT_HEAD", "a revert", "revert"),
    ("sequencer", "a cherry-pick or revert sequence", "cherry-pick"),
    ("BISECT_LOG", "a bisect", "bisect"),
)
"""(state file in the git dir, the operation it shows, its git command);
the first that exists names the operation."""


def operation_in_progress(repo: Path, allow_bisect: bool = False) -> str | None:
    """A sentence naming the git operation `repo`'s work tree is in the
    middle of (rebase, merge, cherry-pick, revert, bisect, am, or
    unresolved conflicts) and how to end it; None when there is none. The
    state files are looked up where git keeps them for this work tree
    (`git rev-parse --git-path`)."""
    args = [arg for name, _, _ in OPERATIONS for arg in ("--git-path", name)]
    found = git("rev-parse", *args, cwd=repo).stdout.splitlines()
    for (name, what, command), where in zip(OPERATIONS, found):
        if allow_bisect and command == "bisect":
            continue
        if (repo / where).exists():
            end = (
                "`git bisect reset`"
                if command == "bisect"
                else f"`git {command} --continue` or `git {command} --abort`"
            )
            return (
                f"{repo} is in the middle of {what} ({name} in its git dir); "
                f"end it first ({end})"
            )
    unmerged = git("ls-files", "--unmerged", cwd=repo).stdout.splitlines()
    conflicted = sorted({line.split("\t", 1)[1] for line in unmerged if "\t" in line})
    if conflicted:
        return (
            f"{repo} has unresolved conflicts in {', '.join(conflicted)}; "
            "resolve them (and `git add` them) or discard them first"
        )
    return None


def require_no_operation(repo: Path, allow_bisect: bool = False) -> None:
    """Raise naming the git operation `repo` is in the middle of, if any."""
    if message := operation_in_progress(repo, allow_bisect):
        raise PatchsetError(f"{message} (nothing was changed)")


def require_clean_checkout(src: Path, allow_bisect: bool = False) -> str:
    """HEAD of a clean vLLM git checkout; raise if it is not one (not the
    top of a checkout, in the middle of a git operation, or with
    uncommitted changes). `allow_bisect`: a bisect in progress is fine
    (`bisect-run` runs inside one)."""
    if not src.is_dir():
        raise PatchsetError(f"{src}: no such directory")
    top = git("rev-parse", "--show-toplevel", cwd=src, check=False)
    if top.returncode or Path(top.stdout.strip()).resolve() != src.resolve():
        raise PatchsetError(f"{src}: not the top of a git checkout")
    require_no_operation(src, allow_bisect)
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=src).stdout
    if dirty.strip():
        raise PatchsetError(
            f"{src}: has uncommitted changes; commit or stash them first:\n{dirty}"
        )
    return git("rev-parse", "HEAD", cwd=src).stdout.strip()


DESCRIBED = re.compile(r"^v(\d+)\.(\d+)\.(\d+)(\S*?)(?:-(\d+)-g[0-9a-f]+)?$")


def checkout_version(src: Path) -> tuple[tuple[int, ...], str, str] | None:
    """(release numbers, vLLM version, how git said it) of HEAD of `src`,
    by the one rule every command follows: the `vX.Y.Z` tag `git describe`
    finds, as setuptools-scm reads it (`0.34.0` at the tag, `0.34.1.dev12`
    twelve commits after it; `0.35.0rc1.dev3` after `v0.35.0rc1`). An
    untracked `vllm/_version.py` left by a build never decides it. None
    when no release tag precedes HEAD."""
    said = git(
        "describe", "--tags", "--match", "v[0-9]*", "HEAD", cwd=src, check=False
    ).stdout.strip()
    if not (match := DESCRIBED.match(said)):
        return None
    numbers = tuple(int(n) for n in match.groups()[:3])
    suffix, after = match.group(4), match.group(5)
    if after and not suffix:
        numbers = (*numbers[:2], numbers[2] + 1)
    version = ".".join(map(str, numbers)) + suffix + (f".dev{after}" if after else "")
    return numbers, version, f"git describe: {said}"


def release_of(src: Path) -> Base | None:
    """The newest declared base HEAD of `src` comes at or after
    (`checkout_version`); None when it precedes them all or nothing says."""
    found = checkout_version(src)
    if found is None:
        return None
    numbers, version, _ = found
    final = version == ".".join(map(str, numbers))
    older = [
        b
        for b in release_order()
        if b.version_key < numbers or (final and b.version_key == numbers)
    ]
    return older[-1] if older else None


def other_release(src: Path, base: Base) -> str | None:
    """Why the checkout `src` is not of `base`'s release line, or None when
    it is (or nothing says which): a release (a tag at HEAD) must be
    `base`'s, a development version must come after `base` and before
    any other declared base (`release_of`)."""
    found = checkout_version(src)
    dev = found is not None and ".dev" in found[1]
    if found is None or (release_of(src) == base if dev else found[1] == base.version):
        return None
    return (
        f"{src} is vLLM {found[1]} ({found[2]}), not a checkout of vLLM "
        f"{base.version}, the release this series is for"
    )


def refuse_applied(src: Path, patches: list[Patch]) -> None:
    """Raise if any patch is already applied at HEAD of `src` (a half-applied
    series), which a three-way `git am` could otherwise turn into a no-op."""
    for patch in patches:
        proc = git(
            "apply", "--check", "--reverse", str(patch.path), cwd=src, check=False
        )
        if proc.returncode == 0:
            raise PatchsetError(
                f"{patch.name}: already applied at HEAD of {src} (is the series "
                "half-applied?); start from a commit without it"
            )


def _hunk_failure(src: Path, head: str, patches: list[Patch], failed: Patch) -> str:
    """Re-apply the patches before `failed` in a scratch clone and ask a
    plain `git apply --check` which file and hunk of `failed` do not apply
    (a three-way `git am` reports only the conflicting file)."""
    with scratch_clone(src, commit=head) as scratch:
        before = patches[: patches.index(failed)]
        if before:
            git(
                "am",
                "--keep-non-patch",
                "--quiet",
                *(str(p.path) for p in before),
                cwd=scratch,
                check=False,
            )
        check = git("apply", "--check", str(failed.path), cwd=scratch, check=False)
        if check.returncode == 0:  # e.g. signing the commit failed
            return f"{failed.name}: applies, but `git am` could not commit it"
        return explain_failure(failed, check.stderr)


def am_series(src: Path, patches: list[Patch]) -> None:
    """`git am -3` the whole series onto HEAD of `src` as one session; on
    failure abort it (HEAD and work tree return to where they were) and
    raise naming the patch, file and hunk."""
    if not patches:
        return
    refuse_applied(src, patches)
    head = git("rev-parse", "HEAD", cwd=src).stdout.strip()
    files = [str(p.path) for p in patches]
    proc = git(
        "am",
        "-3",
        "--keep-non-patch",
        "--quiet",
        *files,
        cwd=src,
        check=False,
        env=committer_env(src),
    )
    if proc.returncode == 0:
        return
    output = proc.stdout + proc.stderr
    match = AM_FAILED.search(output)
    failed = patches[int(match.group(1)) - 1] if match else patches[0]
    git("am", "--abort", cwd=src, check=False)
    restored = git("rev-parse", "HEAD", cwd=src).stdout.strip() == head
    message = _hunk_failure(src, head, patches, failed)
    if not restored:
        message += f"\n(could not restore HEAD to {head}; check {src})"
    raise PatchsetError(
        f"{message}\n{src} is left at {head[:12]}, as it was.\n"
        f"git said:\n{output.strip()}"
    )


@contextlib.contextmanager
def scratch_clone(
    src: Path, commit: str = "HEAD", sparse: list[str] | None = None
) -> Iterator[Path]:
    """A throw-away clone of `src` checked out at `commit` (only the paths
    `sparse` lists, if given), sharing its objects (`git clone --shared`)
    and its committer identity; nothing is written into `src`, whatever
    happens in the clone. Removed on exit."""
    with trees.scratch("patchset-scratch-") as tmp:
        clone = tmp / "clone"
        shared = ("--quiet", "--shared", "--no-checkout", str(src), str(clone))
        git("clone", *shared, cwd=src)
        for key in ("user.name", "user.email"):
            value = git("config", "--get", key, cwd=src, check=False).stdout.strip()
            if value:
                git("config", key, value, cwd=clone)
        if sparse is not None:
            git("config", "core.sparseCheckout", "true", cwd=clone)
            listed = clone / ".git" / "info" / "sparse-checkout"
            listed.parent.mkdir(parents=True, exist_ok=True)
            listed.write_text("".join(f"/{path}\n" for path in sparse))
        sha = git("rev-parse", "--verify", f"{commit}^{{commit}}", cwd=src).stdout
        git("checkout", "--quiet", "--detach", sha.strip(), cwd=clone)
        yield clone


def fetch_commits(src: Path, clone: Path, commits: list[str]) -> None:
    """Copy `commits` (made in `clone`) into `src`'s objects; no ref of
    `src` is written (a later `publishing` step points refs at them)."""
    names = [f"refs/patchset-scratch/{n}" for n in range(len(commits))]
    for name, commit in zip(names, commits):
        git("update-ref", name, commit, cwd=clone)
    quiet = ("--quiet", "--no-tags", "--no-write-fetch-head")
    git("fetch", *quiet, str(clone), *names, cwd=src)


def fast_forward(src: Path, old: str, new: str, undo: Undo) -> None:
    """Move the clean checkout `src` from commit `old` to `new`: its index
    and files (refusing to overwrite an untracked file), then HEAD,
    registering in `undo` how to put each back."""
    added = git(
        "diff-tree", "-r", "-z", "--name-only", "--no-renames", "--diff-filter=A",
        old, new, cwd=src,
    ).stdout.split("\0")  # fmt: skip
    ours = [src / p for p in added if p and not os.path.lexists(src / p)]
    undo.append(partial(git, "read-tree", "--reset", "-u", old, cwd=src))
    undo.append(partial(_remove, ours, src))
    git("read-tree", "-m", "-u", old, new, cwd=src)
    git("update-ref", "-m", "patchset: fast-forward", "HEAD", new, old, cwd=src)


def _remove(files: list[Path], top: Path) -> None:
    """Remove `files` (those that are there) and the folders left empty
    up to `top`."""
    for path in files:
        path.unlink(missing_ok=True)
        for folder in path.parents:
            if folder == top or not folder.is_relative_to(top):
                break
            if folder.is_dir() and any(folder.iterdir()):
                break
            if folder.is_dir():
                folder.rmdir()
