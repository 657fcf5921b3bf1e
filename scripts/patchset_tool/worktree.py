# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The developer loop, as in quilt: a git work tree, `refresh N`, and
`rebase --onto VERSION` to port the series to another release.

`worktree` makes a git clone of the release history (the sdists, with
tests/, tools/ and .buildkite/) at the base's tag, tagged `patchset-base`
after proving the files the series touches equal the installed wheel's
RECORD, and applies the base's series on top, one commit per patch.

`refresh N` folds the uncommitted edits into commit N, regenerates patch N
and every later patch (their context may move) keeping each header, and
copies the result into the base's overlay. A work tree records which state
of the series its commits hold (`.git/patchset-series`); `worktree` and
`refresh` refuse one whose series has changed since, so that stale commits
never overwrite newer patches.

`rebase --onto` applies the series of an older base at its own tag and
three-way merges each commit onto the new base's tag, as `git rebase`
does. A conflict stops in the work tree, naming the patch, file and
hunks; once the maintainer resolves it and finishes the rebase, `refresh`
writes the new base's series and overlay.
"""

import shutil
import tempfile
from pathlib import Path

from . import gitutil, paths, trees, upstream
from .bases import Base
from .digests import git_blob_id, record_digest
from .distinfo import check_base, default_install
from .errors import PatchsetError
from .gitutil import IDENTITY, git
from .series import Patch, Series

BASE_TAG = "patchset-base"
# In .git/ of a work tree the tool made: the id of the series its commits
# were made from or last written to.
SERIES_STAMP = "patchset-series"


def default_worktree(base: Base) -> Path:
    return base.build_dir() / "work"


def is_own_worktree(work: Path) -> bool:
    """Whether `work` is a work tree this tool made (its marker lives in
    .git/, out of the commits; older ones are known by their tag)."""
    if (work / ".git" / trees.MARKER).is_file():
        return True
    return (work / ".git").is_dir() and (
        git(
            "rev-parse",
            "-q",
            "--verify",
            f"refs/tags/{BASE_TAG}",
            cwd=work,
            check=False,
        ).returncode
        == 0
    )


def _stamp_series(work: Path, series: Series) -> None:
    """Record in `work`'s .git/ that its commits hold `series`."""
    (work / ".git" / SERIES_STAMP).write_text(series.id + "\n")


def _refuse_stale(work: Path, series: Series) -> None:
    """Raise when `work` is a work tree this tool made from another state
    of the series: its commits would undo the patches' later changes. A
    checkout of the user's records nothing and is taken as it is."""
    stamp = work / ".git" / SERIES_STAMP
    if not stamp.is_file() and not is_own_worktree(work):
        return
    recorded = stamp.read_text().strip() if stamp.is_file() else None
    if recorded != series.id:
        raise PatchsetError(
            f"{work}: the series in {series.base.patches} changed after this "
            "work tree was made or last refreshed, and its commits would undo "
            f"that; carry any edits over by hand, remove it (`rm -rf {work}`) "
            f"and run `scripts/patchset worktree --base {series.base.version}` "
            "again (nothing was changed)"
        )


def _refuse_dest(dest: Path) -> None:
    """Raise unless `dest` is absent or an empty folder of the user's."""
    if dest.is_dir() and is_own_worktree(dest):
        raise PatchsetError(
            f"{dest}: a work tree patchset made is already there; edit it and "
            "run `scripts/patchset refresh N`, or remove it (`rm -rf "
            f"{dest}`) and run again (nothing was changed)"
        )
    trees.refuse_foreign(dest, "--dest")


def _clone_release(dest: Path, base: Base) -> Path:
    """A staging clone of the release history on a branch at `base`'s
    tag, tagged `patchset-base`; the caller renames it to `dest` (absent
    or empty) while holding its lock."""
    _refuse_dest(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    trees.remove_stale(dest)  # only the marked staging folders a killed run left
    staging = trees.make_staging(dest) / "tree"
    git(
        "clone",
        "--quiet",
        str(upstream.release_history()),
        str(staging),
        cwd=staging.parent,
    )
    trees.mark(staging / ".git", "work-tree")
    git("checkout", "--quiet", "-b", f"glm5next-{base.version}", base.tag, cwd=staging)
    git("tag", BASE_TAG, cwd=staging)
    return staging


def _prove_source_is_the_wheel(work: Path, series: Series) -> None:
    """The sdist's copies of the files the series touches must equal the
    installed wheel's (RECORD), so that patches made here apply there."""
    base = series.base
    install = default_install(base)
    base_files = check_base(install, series)
    drifted = [
        f for f in base_files if record_digest(work / f) != install.record.get(f)
    ]
    if drifted:
        raise PatchsetError(
            f"the vLLM {base.version} source differs from the installed "
            f"wheel in: {drifted}"
        )


def create(dest: Path, base: Base) -> tuple[int, bool]:
    """Create `base`'s work tree at `dest`: its release source, with the
    files the series touches proven equal to the installed wheel's RECORD,
    and one commit per patch on top. A work tree the tool made there
    before is reused when its commits still hold the series. Return (the
    number of patches, whether it was reused)."""
    series = Series.load(base)
    patches = series.patches
    if dest.is_dir() and is_own_worktree(dest):
        _refuse_stale(dest, series)
        try:
            series_commits(dest, patches)
        except PatchsetError:
            raise PatchsetError(
                f"{dest}: a work tree patchset made is already there, but its "
                "commits no longer match the series; finish your edits there "
                "with `scripts/patchset refresh N`, or remove it (`rm -rf "
                f"{dest}`) and run again (nothing was changed)"
            ) from None
        return len(patches), True
    _refuse_dest(dest)
    with trees.locked(dest):
        staging = _clone_release(dest, base)
        try:
            _prove_source_is_the_wheel(staging, series)
            gitutil.am_series(staging, patches)
            _stamp_series(staging, series)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging.parent, ignore_errors=True)
    return len(patches), False


def rebase(source: Base, onto: Base, dest: Path) -> list[str]:
    """Port `source`'s series to `onto`'s release in a new work tree at
    `dest`: apply it at `source`'s tag, then three-way merge each commit
    onto `onto`'s tag. Return the subjects now on the new base; on a
    conflict, leave the rebase stopped in `dest` and raise naming the
    patch, the files and their conflicting hunks."""
    patches = Series.load(source).patches
    if onto.series_file.exists():
        raise PatchsetError(
            f"{onto.series_file} exists: vLLM {onto.version} already has a "
            f"series; edit it with `worktree --base {onto.version}` instead"
        )
    branch = f"glm5next-{onto.version}"
    _refuse_dest(dest)
    with trees.locked(dest):
        staging = _clone_release(dest, onto)
        try:
            git("checkout", "--quiet", "--detach", source.tag, cwd=staging)
            gitutil.am_series(staging, patches)
            git("branch", "--force", branch, "HEAD", cwd=staging)
            git("checkout", "--quiet", branch, cwd=staging)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging.parent, ignore_errors=True)
    proc = git(
        *IDENTITY, "rebase", "--onto", onto.tag, source.tag, cwd=dest, check=False
    )
    if proc.returncode:
        raise PatchsetError(
            _rebase_conflict(dest, patches, proc.stdout + proc.stderr, onto)
        )
    return [p.subject for p in patches]


def _rebase_conflict(work: Path, patches: list[Patch], output: str, onto: Base) -> str:
    """Which patch stopped the rebase, and its conflicting files and hunks."""
    subject = git("log", "-1", "--format=%s", "REBASE_HEAD", cwd=work, check=False)
    stopped = next(
        (p.name for p in patches if p.subject == subject.stdout.strip()), "a patch"
    )
    files = git("diff", "--name-only", "--diff-filter=U", cwd=work).stdout.split()
    where = []
    for path in files:
        lines = (work / path).read_text(errors="replace").splitlines()
        starts = [n for n, line in enumerate(lines, 1) if line.startswith("<<<<<<<")]
        where.append(
            f"{path}: {len(starts)} conflicting hunk(s), at line(s) "
            + ", ".join(map(str, starts))
        )
    return (
        f"{stopped} does not merge onto vLLM {onto.version}:\n  "
        + "\n  ".join(where or [output.strip()])
        + f"\nThe rebase is stopped in {work}. Resolve the conflicts there, "
        "`git add` the files and run `git rebase --continue`; then "
        f"`scripts/patchset refresh 1 --base {onto.version}` writes the series."
    )


def write_new_series(work: Path, base: Base) -> list[str]:
    """Write every commit after `patchset-base` in `work` as `base`'s
    series (patches, `series` file and overlay); return the patch names."""
    if (work / ".git" / "rebase-merge").exists() or (
        work / ".git" / "rebase-apply"
    ).exists():
        raise PatchsetError(
            f"{work}: a rebase is still in progress; resolve it and run "
            "`git rebase --continue` first"
        )
    if git("status", "--porcelain", "--untracked-files=no", cwd=work).stdout.strip():
        raise PatchsetError(
            f"{work}: commit or amend the edits into the port's commits first "
            "(the new series is written from commits alone)"
        )
    base.patches.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".series-", dir=base.patches))
    try:
        made = git(
            "format-patch",
            "--full-index",
            "-o",
            str(staging),
            f"{BASE_TAG}..HEAD",
            cwd=work,
        ).stdout.split()
        names = [Path(m).name for m in made]
        for name in names:
            (staging / name).rename(base.patches / name)
        # The series file last: until it exists, the base has no series.
        (staging / "series").write_text("".join(n + "\n" for n in names))
        (staging / "series").rename(base.series_file)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _finish_refresh(work, base)
    return names


def series_commits(work: Path, patches: list[Patch], new: int = 0) -> list[str]:
    """The commits of `work` that hold the series, checked by subject,
    followed by `new` commits for patches not yet in the series."""
    log = git(
        "log", "--reverse", "--format=%H %s", f"{BASE_TAG}..HEAD", cwd=work
    ).stdout.splitlines()
    commits = [line.split(" ", 1) for line in log]
    subjects = [c[1] if len(c) > 1 else "" for c in commits]
    want = [p.subject for p in patches]
    if subjects[: len(patches)] != want:
        raise PatchsetError(
            f"{work}: the commits after {BASE_TAG} do not match the series "
            f"(got {subjects}, want {want}); keep one commit per patch with "
            "its subject (`git rebase -i patchset-base` to reword or reorder)"
        )
    extra = commits[len(patches) :]
    if len(extra) != new:
        listing = "\n  ".join(
            f"{c[0][:12]} {c[1] if len(c) > 1 else ''}" for c in extra
        )
        raise PatchsetError(
            f"{work}: {len(extra)} commit(s) after the series' {len(patches)}:\n"
            f"  {listing}\n"
            "Fold each into the patch it belongs to: `git commit --fixup=<that "
            "patch's commit>` then `git rebase -i --autosquash patchset-base` "
            "(or `git commit --amend` when it is the last), and run `scripts/"
            f"patchset refresh N` again; or, for one commit that is a new "
            f"patch, run `scripts/patchset refresh {len(patches) + 1}`"
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
    proc = git(
        *IDENTITY,
        "rebase",
        "--quiet",
        "-i",
        "--autosquash",
        f"{target}^",
        cwd=work,
        env=env,
        check=False,
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


def refresh(number: int, work: Path, base: Base) -> list[str]:
    """Regenerate patch `number` (1-based) and later ones from `work`;
    return the names of the patch files that changed."""
    if not base.series_file.exists():
        return write_new_series(work, base)
    series = Series.load(base)
    patches = series.patches
    _refuse_stale(work, series)
    _refuse_unrefreshed_copies(work, series)
    if number == len(patches) + 1:
        return [add_patch(work, series)]
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
    _finish_refresh(work, base)
    return changed


def _refuse_unrefreshed_copies(work: Path, series: Series) -> None:
    """Refresh overwrites vllm_overlay/ and the model tests from the work
    tree; refuse while either holds edits that neither the series nor the
    work tree has."""
    _, last = series.blob_chain()
    edited = []
    for path, blob in last.items():
        copy = series.base.copy_of(path)
        if not copy.is_file():
            continue
        data = copy.read_bytes()
        in_work = (work / path).is_file() and (work / path).read_bytes() == data
        if git_blob_id(data) != blob and not in_work:
            edited.append(copy)
    if edited:
        raise PatchsetError(
            "these copies were edited outside the work tree and would be "
            "overwritten; copy them into the work tree (or restore them) "
            "first:\n  " + "\n  ".join(str(e) for e in edited)
        )


def add_patch(work: Path, series: Series) -> str:
    """Turn the one commit after `series` in `work` (with any uncommitted
    edits folded in) into the next patch of the series."""
    base, patches = series.base, series.patches
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
        str(base.patches),
        "-1",
        "HEAD",
        cwd=work,
    ).stdout.strip()
    name = Path(made).name
    with open(base.series_file, "a") as listing:
        listing.write(name + "\n")
    _finish_refresh(work, base)
    return name


def _finish_refresh(work: Path, base: Base) -> None:
    """After writing `base`'s series from `work`: update the overlay and
    record that `work` holds the series now."""
    series = Series.load(base)
    _update_copies(work, series)
    if is_own_worktree(work):
        _stamp_series(work, series)


def _update_copies(work: Path, series: Series) -> None:
    """Make the base's overlay equal the work tree's result of `series`."""
    base, touched = series.base, series.touched
    for path in touched:
        source, target = work / path, base.copy_of(path)
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        elif target.exists():
            target.unlink()
    for stale in paths.files_under(base.overlay):
        rel = stale.relative_to(base.overlay).as_posix()
        if rel not in touched:
            print(
                f"note: {stale} is in no patch; left in place for you to "
                "move into a patch or delete (`check` reports it)"
            )
