# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Thin wrappers over the git command line: every git the tool runs goes
through `git` here (in the C locale), with the tool's one commit IDENTITY and
the scratch worktrees that leave a checkout alone."""

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import PatchsetError
from .series import Patch

FAILED_AT = re.compile(r"error: patch failed: (\S+):(\d+)")
AM_FAILED = re.compile(r"Patch failed at (\d{4})")
EXISTS = re.compile(r"error: (\S+): already exists in (?:working directory|index)")
CORRUPT = re.compile(r"(corrupt patch at line \d+)")
TOOL_NAME, TOOL_EMAIL = "patchset", "patchset@localhost"
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
    fixed.pop("LANGUAGE", None)
    return fixed


def git(
    *args: str, cwd: Path, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run git in `cwd` (every git the tool runs goes through here, in the
    C locale); raise a PatchsetError with git's message on failure."""
    proc = subprocess.run(
        [git_exe(), *args], cwd=cwd, text=True, capture_output=True, env=git_env(env)
    )
    if check and proc.returncode:
        raise PatchsetError(
            f"git {' '.join(args)} failed in {cwd}:\n{proc.stderr.strip()}"
        )
    return proc


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


def require_clean_checkout(src: Path) -> str:
    """HEAD of a clean vLLM git checkout; raise if it is not one."""
    if not src.is_dir():
        raise PatchsetError(f"{src}: no such directory")
    top = git("rev-parse", "--show-toplevel", cwd=src, check=False)
    if top.returncode or Path(top.stdout.strip()).resolve() != src.resolve():
        raise PatchsetError(f"{src}: not the top of a git checkout")
    git_dir = Path(git("rev-parse", "--absolute-git-dir", cwd=src).stdout.strip())
    for marker in ("rebase-apply", "rebase-merge", "MERGE_HEAD"):
        if (git_dir / marker).exists():
            raise PatchsetError(
                f"{src}: a git am/rebase/merge is in progress; finish or abort it"
            )
    dirty = git("status", "--porcelain", "--untracked-files=no", cwd=src).stdout
    if dirty.strip():
        raise PatchsetError(
            f"{src}: has uncommitted changes; commit or stash them first:\n{dirty}"
        )
    return git("rev-parse", "HEAD", cwd=src).stdout.strip()


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
    """Re-apply the patches before `failed` in a scratch worktree and ask a
    plain `git apply --check` which file and hunk of `failed` do not apply
    (a three-way `git am` reports only the conflicting file)."""
    with scratch_worktree(src, commit=head) as scratch:
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


class scratch_worktree:
    """A worktree of `src` at `commit` (detached, or on a new `branch`),
    removed on exit."""

    def __init__(
        self, src: Path, branch: str | None = None, commit: str = "HEAD"
    ) -> None:
        self.src, self.branch, self.commit = src, branch, commit
        self.path = Path(tempfile.mkdtemp(prefix="patchset-worktree-"))

    def __enter__(self) -> Path:
        self.path.rmdir()
        args = ["-b", self.branch] if self.branch else ["--detach"]
        git(
            "worktree",
            "add",
            "--quiet",
            *args,
            str(self.path),
            self.commit,
            cwd=self.src,
        )
        return self.path

    def __exit__(self, *exc: object) -> None:
        git("worktree", "remove", "--force", str(self.path), cwd=self.src, check=False)
        shutil.rmtree(self.path, ignore_errors=True)
        git("worktree", "prune", cwd=self.src, check=False)
