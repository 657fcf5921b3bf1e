# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The developer loop, as in quilt: a git work tree and `refresh N`.

`worktree` makes a git repository whose first commit (tagged
`patchset-base`) is the pristine installed package, verified against
RECORD, and whose following commits are the series, one per patch.
`refresh N` folds the uncommitted edits into commit N, regenerates patch N
and every later patch (their context may move) keeping each header, and
copies the result into vllm_overlay/ and tests/models/glm5next/.
"""

import shutil
import subprocess
from pathlib import Path

from . import apply, gitutil, paths
from .errors import PatchsetError
from .gitutil import git
from .series import Patch, load_series

BASE_TAG = "patchset-base"
IDENTITY = ["-c", "user.name=patchset", "-c", "user.email=patchset@localhost"]


def default_worktree() -> Path:
    return paths.build_dir() / "work"


def create(dest: Path) -> int:
    """Create the work tree at `dest`; return the number of patches."""
    if dest.exists():
        raise PatchsetError(f"{dest} exists; remove it or pass another --dest")
    install = apply.default_install()
    patches = load_series(paths.PATCHES)
    apply._check_base(install, patches)
    staging = dest.with_name(f".{dest.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        shutil.copytree(
            install.package,
            staging / "vllm",
            ignore=shutil.ignore_patterns("__pycache__", "*.so"),
        )
        git("init", "--quiet", cwd=staging)
        git("add", "--all", cwd=staging)
        git(
            *IDENTITY,
            "commit",
            "--quiet",
            "-m",
            f"vLLM {paths.VLLM_VERSION} ({paths.VLLM_COMMIT}) as installed",
            cwd=staging,
        )
        git("tag", BASE_TAG, cwd=staging)
        gitutil.am_series(staging, patches)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return len(patches)


def series_commits(work: Path, patches: list[Patch]) -> list[str]:
    """The commits of `work` that hold the series, checked by subject."""
    log = git(
        "log", "--reverse", "--format=%H %s", f"{BASE_TAG}..HEAD", cwd=work
    ).stdout.splitlines()
    commits = [line.split(" ", 1) for line in log]
    subjects = [c[1] if len(c) > 1 else "" for c in commits]
    if subjects != [p.subject for p in patches]:
        raise PatchsetError(
            f"{work}: the commits after {BASE_TAG} do not match the series "
            f"(got {subjects}, want {[p.subject for p in patches]}); "
            "recreate it with `scripts/patchset worktree`"
        )
    return [c[0] for c in commits]


def _fold_edits(work: Path, target: str) -> None:
    """Commit the uncommitted edits as a fixup of `target` and squash it;
    on a conflict, restore the edits as they were and raise."""
    head = git("rev-parse", "HEAD", cwd=work).stdout.strip()
    git("add", "--all", cwd=work)
    git(*IDENTITY, "commit", "--quiet", f"--fixup={target}", cwd=work)
    env = gitutil.outside_repo_env(work)
    env["GIT_SEQUENCE_EDITOR"] = "true"
    proc = subprocess.run(
        [
            gitutil.git_exe(),
            *IDENTITY,
            "rebase",
            "--quiet",
            "-i",
            "--autosquash",
            f"{target}^",
        ],
        cwd=work,
        env=env,
        text=True,
        capture_output=True,
    )
    if proc.returncode:
        git("rebase", "--abort", cwd=work, check=False)
        git("reset", "--quiet", "--mixed", head, cwd=work)
        raise PatchsetError(
            f"folding the edits into {target[:12]} conflicts with a later "
            f"patch; the edits are left uncommitted in {work}.\n"
            f"{proc.stdout}{proc.stderr}"
        )


def _splice(old: Patch, fresh: str) -> str:
    """`old`'s header and message with `fresh`'s diff."""
    text = old.path.read_text()
    header = text[: text.index("\n---\n") + 1]
    return header + fresh[fresh.index("\n---\n") + 1 :]


def refresh(number: int, work: Path) -> list[str]:
    """Regenerate patch `number` (1-based) and later ones from `work`;
    return the names of the patch files that changed."""
    patches = load_series(paths.PATCHES)
    if not 1 <= number <= len(patches):
        raise PatchsetError(f"refresh: no patch {number} (series has {len(patches)})")
    commits = series_commits(work, patches)
    if git("status", "--porcelain", cwd=work).stdout.strip():
        _fold_edits(work, commits[number - 1])
        commits = series_commits(work, patches)
    changed = []
    for patch, commit in list(zip(patches, commits))[number - 1 :]:
        fresh = git(
            "format-patch", "--full-index", "--stdout", "-1", commit, cwd=work
        ).stdout
        text = _splice(patch, fresh)
        if text != patch.path.read_text():
            patch.path.write_text(text)
            changed.append(patch.name)
    _update_copies(work, load_series(paths.PATCHES))
    return changed


def _update_copies(work: Path, patches: list[Patch]) -> None:
    """Make vllm_overlay/ and the model tests equal the work tree's result."""
    touched = apply.touched_files(patches)
    for path in touched:
        where = paths.OVERLAY if path.startswith("vllm/") else paths.REPO
        source, target = work / path, where / path
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        elif target.exists():
            target.unlink()
    for stale in paths.files_under(paths.OVERLAY):
        rel = stale.relative_to(paths.OVERLAY).as_posix()
        if rel not in touched:
            stale.unlink()
