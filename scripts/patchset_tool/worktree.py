# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The developer loop, as in quilt: a git work tree and `refresh N`.

`worktree` makes a git clone of vLLM 0.33.0's source (its sdist, with
tests/, tools/ and .buildkite/), tagged `patchset-base` after proving the
files the series touches equal the installed wheel's RECORD, and applies
the series on top, one commit per patch.
`refresh N` folds the uncommitted edits into commit N, regenerates patch N
and every later patch (their context may move) keeping each header, and
copies the result into vllm_overlay/ and tests/models/glm5next/.
"""

import shutil
import subprocess
from pathlib import Path

from . import apply, check, gitutil, paths, upstream
from .errors import PatchsetError
from .gitutil import git
from .pristine import file_digest
from .series import Patch, load_series

BASE_TAG = "patchset-base"
IDENTITY = ["-c", "user.name=patchset", "-c", "user.email=patchset@localhost"]


def default_worktree() -> Path:
    return paths.build_dir() / "work"


def create(dest: Path) -> int:
    """Create the work tree at `dest`: a clone of vLLM 0.33.0's source whose
    files touched by the series are proven equal to the installed wheel's
    RECORD; return the number of patches applied on top."""
    if dest.exists():
        raise PatchsetError(f"{dest} exists; remove it or pass another --dest")
    install = apply.default_install()
    patches = load_series(paths.PATCHES)
    base_files = apply.check_base(install, patches)
    staging = dest.with_name(f".{dest.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        git(
            "clone",
            "--quiet",
            str(upstream.source_checkout()),
            str(staging),
            cwd=staging.parent,
        )
        drifted = [
            f for f in base_files if file_digest(staging / f) != install.record.get(f)
        ]
        if drifted:
            raise PatchsetError(
                f"the vLLM {paths.VLLM_VERSION} source differs "
                f"from the installed wheel in: {drifted}"
            )
        git("tag", BASE_TAG, cwd=staging)
        gitutil.am_series(staging, patches)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return len(patches)


def series_commits(work: Path, patches: list[Patch], new: int = 0) -> list[str]:
    """The commits of `work` that hold the series, checked by subject,
    followed by `new` commits for patches not yet in the series."""
    log = git(
        "log", "--reverse", "--format=%H %s", f"{BASE_TAG}..HEAD", cwd=work
    ).stdout.splitlines()
    commits = [line.split(" ", 1) for line in log]
    subjects = [c[1] if len(c) > 1 else "" for c in commits]
    if len(subjects) != len(patches) + new or subjects[: len(patches)] != [
        p.subject for p in patches
    ]:
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
    _refuse_unrefreshed_copies(work, patches)
    if number == len(patches) + 1:
        return [add_patch(work, patches)]
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


def _refuse_unrefreshed_copies(work: Path, patches: list[Patch]) -> None:
    """Refresh overwrites vllm_overlay/ and the model tests from the work
    tree; refuse while either holds edits that neither the series nor the
    work tree has."""
    _, last = check.file_chain(patches)
    edited = []
    for path, blob in last.items():
        copy = paths.copy_of(path)
        if not copy.is_file():
            continue
        data = copy.read_bytes()
        in_work = (work / path).is_file() and (work / path).read_bytes() == data
        if check.git_blob_id(data) != blob and not in_work:
            edited.append(copy)
    if edited:
        raise PatchsetError(
            "these copies were edited outside the work tree and would be "
            "overwritten; copy them into the work tree (or restore them) "
            "first:\n  " + "\n  ".join(str(e) for e in edited)
        )


def add_patch(work: Path, patches: list[Patch]) -> str:
    """Turn the one commit after the series in `work` (with any uncommitted
    edits folded in) into the next patch of the series."""
    series_commits(work, patches, new=1)
    if git("status", "--porcelain", cwd=work).stdout.strip():
        git("add", "--all", cwd=work)
        git(*IDENTITY, "commit", "--quiet", "--amend", "--no-edit", cwd=work)
    number = len(patches) + 1
    made = git(
        "format-patch",
        "--full-index",
        "--start-number",
        str(number),
        "-o",
        str(paths.PATCHES),
        "-1",
        "HEAD",
        cwd=work,
    ).stdout.strip()
    name = Path(made).name
    with open(paths.SERIES, "a") as series:
        series.write(name + "\n")
    _update_copies(work, load_series(paths.PATCHES))
    return name


def _update_copies(work: Path, patches: list[Patch]) -> None:
    """Make vllm_overlay/ and the model tests equal the work tree's result."""
    touched = apply.touched_files(patches)
    for path in touched:
        source, target = work / path, paths.copy_of(path)
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        elif target.exists():
            target.unlink()
    for stale in paths.files_under(paths.OVERLAY):
        rel = stale.relative_to(paths.OVERLAY).as_posix()
        if rel not in touched:
            print(
                f"note: {stale} is in no patch; left in place for you to "
                "move into a patch or delete (`check` reports it)"
            )
