# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The developer loop, as in quilt: a git work tree, `refresh N`, and
`rebase --onto VERSION` to port the series to another release.

A work tree records which state of the series its commits hold
(`.git/patchset-series`); `worktree` and `refresh` refuse one whose series has
changed since, so that stale commits never overwrite newer patches.
"""

import contextlib
import os
import re
import shutil
import subprocess
from functools import partial
from pathlib import Path

from . import gitutil, paths, trees, upstream
from .apply import apply_patches, write_source_files
from .bases import Base, release_order
from .check import base_files
from .digests import git_blob_id, record_digest
from .distinfo import check_base, default_install
from .errors import PatchsetError
from .gitutil import IDENTITY, git
from .series import Patch, Series, load_series

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


def _stamp_series(work: Path, series: Series) -> dict[Path, bytes | None]:
    """The write that records in `work`'s .git/ that its commits hold
    `series` (none for a checkout of the user's, which records nothing)."""
    if not is_own_worktree(work):
        return {}
    return {work / ".git" / SERIES_STAMP: (series.id + "\n").encode()}


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


def _clone_release(dest: Path, base: Base, staging: Path) -> Path:
    """A clone at `staging` of the release history on a branch at `base`'s
    tag, tagged `patchset-base`; the caller renames it to `dest` (absent
    or empty) while holding its lock."""
    _refuse_dest(dest)
    trees.remove_stale(dest)  # only the marked staging folders a killed run left
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
    dest = Path(os.path.abspath(dest))  # git runs in other folders
    series = Series.load(base)
    patches = series.patches
    if dest.is_dir() and is_own_worktree(dest):
        gitutil.require_no_operation(dest)
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
    with trees.locked(dest), trees.staging(dest) as work:
        staging = _clone_release(dest, base, work / "tree")
        _prove_source_is_the_wheel(staging, series)
        gitutil.am_series(staging, patches)
        (staging / ".git" / SERIES_STAMP).write_text(series.id + "\n")
        with gitutil.publishing(f"the work tree {dest}"):
            staging.rename(dest)
    return len(patches), False


def rebase(source: Base, onto: Base, dest: Path) -> list[str]:
    """Port `source`'s series to `onto`'s release in a new work tree at
    `dest`: apply it at `source`'s tag, then three-way merge each commit
    onto `onto`'s tag. Return the subjects now on the new base; on a
    conflict, leave the rebase stopped in `dest` and raise naming the
    patch, the files and their conflicting hunks."""
    dest = Path(os.path.abspath(dest))  # git runs in other folders
    patches = Series.load(source).patches
    if onto.series_file.exists():
        raise PatchsetError(
            f"{onto.series_file} exists: vLLM {onto.version} already has a "
            f"series; edit it with `worktree --base {onto.version}` instead"
        )
    branch = f"glm5next-{onto.version}"
    _refuse_dest(dest)
    with trees.locked(dest), trees.staging(dest) as work:
        staging = _clone_release(dest, onto, work / "tree")
        git("checkout", "--quiet", "--detach", source.tag, cwd=staging)
        gitutil.am_series(staging, patches)
        git("branch", "--force", branch, "HEAD", cwd=staging)
        git("checkout", "--quiet", branch, cwd=staging)
        proc = git(
            *IDENTITY, "rebase", "--onto", onto.tag, source.tag, cwd=staging,
            check=False,
        )  # fmt: skip
        with gitutil.publishing(f"the work tree {dest}"):
            staging.rename(dest)
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
    if git("status", "--porcelain", "--untracked-files=no", cwd=work).stdout.strip():
        raise PatchsetError(
            f"{work}: commit or amend the edits into the port's commits first "
            "(the new series is written from commits alone)"
        )
    _refuse_other_base(work, base)
    log = git("log", "--format=%s", f"{BASE_TAG}..HEAD", cwd=work).stdout
    ported = [
        b
        for b in release_order()
        if b.series_file.exists()
        and [p.subject for p in Series.load(b).patches] == log.splitlines()[::-1]
    ]
    if not ported or git("rev-list", "--merges", f"{BASE_TAG}..HEAD", cwd=work).stdout:
        raise PatchsetError(
            f"{work}: its commits after {BASE_TAG} are not one commit per patch "
            "of a declared base's series (is the rebase unfinished, or this "
            f"not `rebase --onto {base.version}`'s work tree?); nothing was written"
        )
    with trees.scratch("patchset-series-") as tmp:
        made = git(
            "format-patch",
            "--full-index",
            "-o",
            str(tmp),
            f"{BASE_TAG}..HEAD",
            cwd=work,
        ).stdout.split()
        names = [Path(m).name for m in made]
        (tmp / "series").write_text("".join(n + "\n" for n in names))
        fresh = Series(base, load_series(tmp))
        writes: dict[Path, bytes | None] = {
            base.patches / n: (tmp / n).read_bytes() for n in [*names, "series"]
        }
        head = git("rev-parse", "HEAD", cwd=work).stdout.strip()
        for path in fresh.touched:
            writes[base.copy_of(path)] = _blob_at(work, head, path)
        _publish(work, writes, fresh)
    return names


def _refuse_other_base(work: Path, base: Base) -> None:
    """Raise unless `work`'s HEAD descends from `patchset-base`, and that
    is `base`'s release tag where `work` has it (a checkout of the user's
    may lack the tag)."""

    def commit(ref: str) -> str:
        return git(
            "rev-parse", "-q", "--verify", f"{ref}^{{commit}}", cwd=work, check=False
        ).stdout

    at, tag = commit(BASE_TAG), commit(base.tag)
    descends = git(
        "merge-base", "--is-ancestor", BASE_TAG, "HEAD", cwd=work, check=False
    )
    if not at or descends.returncode or (tag and tag != at):
        raise PatchsetError(
            f"{work}: its HEAD does not descend from {BASE_TAG} at vLLM "
            f"{base.version}'s tag {base.tag}: not a work tree of this base "
            "(nothing was written)"
        )


def series_commits(
    work: Path, patches: list[Patch], new: int = 0, head: str = "HEAD"
) -> list[str]:
    """The commits of `work` up to `head` that hold the series, checked by
    subject, followed by `new` commits for patches not yet in the series."""
    log = git(
        "log", "--reverse", "--format=%H %s", f"{BASE_TAG}..{head}", cwd=work
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
    if new and not extra:
        raise PatchsetError(
            f"{work}: `refresh {len(patches) + 1}` turns one commit made after "
            f"the series' {len(patches)} into a new patch, and there is none; "
            "commit the new patch's changes first (`git commit` with its "
            "subject, a body saying why and a Signed-off-by line), or fold "
            "uncommitted edits into an existing patch with `refresh N` "
            "(nothing was changed)"
        )
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


def _snapshot(work: Path) -> str:
    """The tree of `work`'s tracked files as they are on disk (staged or
    not; a file `git add`ed counts, an untracked one never does), written
    with a scratch index so that the user's index is left alone."""
    index = Path(git("rev-parse", "--git-path", "index", cwd=work).stdout.strip())
    index = index if index.is_absolute() else work / index
    with trees.scratch("patchset-index-") as tmp:
        scratch = tmp / "index"
        if index.is_file():
            shutil.copy2(index, scratch)  # its mtime: git's racy-clean check
        env = {**os.environ, "GIT_INDEX_FILE": str(scratch)}
        git("add", "--update", cwd=work, env=env)
        return git("write-tree", cwd=work, env=env).stdout.strip()


CONFLICT_MARKER = re.compile(r"^\+(<{7}|>{7}|\|{7})( |$)", re.M)


def _refuse_unfoldable(work: Path, tree: str, base: Base) -> list[str]:
    """The paths whose edits (HEAD to `tree`) would be folded; raise when
    one holds conflict markers."""
    changed = git(
        "diff", "--name-only", "--no-renames", "HEAD", tree, cwd=work
    ).stdout.splitlines()
    if not changed:
        return []
    diff = git("diff", "--no-renames", "HEAD", tree, cwd=work).stdout
    if CONFLICT_MARKER.search(diff):
        marked = [
            path
            for path in changed
            if CONFLICT_MARKER.search(
                git("diff", "HEAD", tree, "--", path, cwd=work).stdout
            )
        ]
        raise PatchsetError(
            f"{work}: conflict markers in {', '.join(marked)}; resolve them "
            "before refreshing (nothing was changed)"
        )
    return changed


def _fold(work: Path, target: str, tree: str) -> str:
    """The commit that `git rebase -i --autosquash` makes of the series
    once the edits `tree` holds are folded into `target` as a fixup. It
    runs in a throw-away sparse clone (sharing `work`'s objects), so that
    `work`, its branches and its git dir are left alone whatever happens
    (a conflict, an interrupt); raise when the edits conflict with a later
    patch or change what it makes of them."""
    head = git("rev-parse", "HEAD", cwd=work).stdout.strip()
    subject = git("log", "-1", "--format=%s", target, cwd=work).stdout.strip()
    fixup = git(
        *IDENTITY, "commit-tree", tree, "-p", head, "-m", f"fixup! {subject}", cwd=work
    ).stdout.strip()
    touched = git(
        "diff", "--name-only", "--no-renames", f"{target}^", fixup, cwd=work
    ).stdout.splitlines()
    env = {**os.environ, "GIT_SEQUENCE_EDITOR": "true", "GIT_EDITOR": "true"}
    left = (
        f"the edits are left uncommitted in {work}, as they were (nothing was changed)"
    )
    with gitutil.scratch_clone(work, fixup, sparse=touched) as clone:
        proc = git(
            *IDENTITY, "rebase", "--quiet", "-i", "--autosquash", f"{target}^",
            cwd=clone, env=env, check=False,
        )  # fmt: skip
        if proc.returncode:
            raise PatchsetError(
                f"folding the edits into {target[:12]} conflicts with a later "
                f"patch; {left}.\n{proc.stdout}{proc.stderr}"
            )
        folded = git("rev-parse", "HEAD", cwd=clone).stdout.strip()
        gitutil.fetch_commits(work, clone, [folded])
    if git("rev-parse", f"{folded}^{{tree}}", cwd=work).stdout.strip() != tree:
        raise PatchsetError(
            f"folding the edits into {target[:12]} changes what a later patch "
            f"makes of them; {left}"
        )
    return folded


def _splice(old: Patch, fresh: str) -> str:
    """`old`'s header and message with `fresh`'s diff."""
    text = old.path.read_text()
    header = text[: text.index("\n---\n") + 1]
    return header + fresh[fresh.index("\n---\n") + 1 :]


def refresh(number: int, work: Path, base: Base) -> list[str]:
    """Regenerate patch `number` (1-based) and later ones from `work`;
    return the names of the patch files that changed. All or nothing: the
    new series is proven (applied to the RECORD-verified base files as
    `apply` applies it, and compared with the work tree) before any file of
    patches/ or the overlay is replaced."""
    gitutil.require_no_operation(work)
    if not base.series_file.exists():
        return write_new_series(work, base)
    series = Series.load(base)
    patches = series.patches
    _refuse_stale(work, series)
    _refuse_other_base(work, base)
    _refuse_unrefreshed_copies(work, series)
    new = int(number == len(patches) + 1)
    if not 1 <= number <= len(patches) + new:
        raise PatchsetError(f"refresh: no patch {number} (series has {len(patches)})")
    commits = series_commits(work, patches, new=new)
    tree = _snapshot(work)
    head = git("rev-parse", "HEAD", cwd=work).stdout.strip()
    if _refuse_unfoldable(work, tree, base):
        head = _fold(work, commits[number - 1], tree)
        commits = series_commits(work, patches, new=new, head=head)
    with trees.scratch("patchset-refresh-") as staging:
        names = [p.name for p in patches]
        texts = {p.name: p.path.read_text() for p in patches}
        for patch, commit in list(zip(patches, commits))[number - 1 :]:
            fresh = git(
                "format-patch", "--full-index", "--stdout", "-1", commit, cwd=work
            ).stdout
            texts[patch.name] = _splice(patch, fresh)
        if new:
            made = git(
                "format-patch",
                "--full-index",
                "--start-number",
                str(number),
                "-o",
                str(staging / "new"),
                "-1",
                commits[-1],
                cwd=work,
            ).stdout.strip()
            names.append(Path(made).name)
            texts[names[-1]] = Path(made).read_text()
        for name in names:
            (staging / name).write_text(texts[name])
        (staging / "series").write_text("".join(n + "\n" for n in names))
        fresh_series = Series(base, load_series(staging))
        overlay = _verify(work, head, fresh_series)
        writes: dict[Path, bytes | None] = {
            base.patches / n: texts[n].encode()
            for n in names
            if n not in {p.name for p in patches}
            or texts[n] != (base.patches / n).read_text()
        }
        if new:
            writes[base.series_file] = (staging / "series").read_bytes()
        writes.update(overlay)
        changed = [n for n in names if base.patches / n in writes]
        _publish(work, writes, fresh_series, head)
    _note_untracked(work)
    return changed


def _verify(work: Path, head: str, series: Series) -> dict[Path, bytes | None]:
    """Apply `series` to the installed base files as `apply` does and
    compare each file it touches with `head` of the work tree; return the
    overlay that follows ({copy: bytes, or None to remove})."""
    overlay: dict[Path, bytes | None] = {}
    with base_files(series, default_install(series.base)) as root:
        write_source_files(root, series)
        apply_patches(series, root)
        for path in series.touched:
            want = _blob_at(work, head, path)
            result = root / path
            got = result.read_bytes() if result.is_file() else None
            if got != want:
                raise PatchsetError(
                    f"{path}: the regenerated series applied to the vLLM "
                    f"{series.base.version} base files does not give the work "
                    f"tree's file; nothing was changed (patches/, the overlay "
                    f"and {work} are as they were)"
                )
            copy = series.base.copy_of(path)
            if want is None:
                if copy.exists():
                    overlay[copy] = None
            elif not copy.is_file() or copy.read_bytes() != want:
                overlay[copy] = want
    return overlay


def _blob_at(work: Path, commit: str, path: str) -> bytes | None:
    """The bytes of `path` at `commit` (undecoded); None where it has none."""
    proc = subprocess.run(
        [gitutil.git_exe(), "cat-file", "blob", f"{commit}:{path}"],
        cwd=work,
        capture_output=True,
        env=gitutil.git_env(),
    )
    return proc.stdout if proc.returncode == 0 else None


def _publish(
    work: Path, writes: dict[Path, bytes | None], series: Series, head: str = ""
) -> None:
    """In one step that signals wait for, and undone whole if it fails:
    write every file of `writes` (None: remove it) and the series stamp
    of `work`, then point `work`'s branch at `head` (the folded series)
    with the index to match (its files already hold the folded edits)."""
    writes = {**writes, **_stamp_series(work, series)}
    with gitutil.publishing(f"the refreshed series (and {work}'s commits)") as undo:
        kept = [_replace(target, data, undo) for target, data in writes.items()]
        old = git("rev-parse", "HEAD", cwd=work).stdout.strip()
        if head and old != head:
            git("update-ref", "-m", "patchset refresh", "HEAD", head, old, cwd=work)
            undo.append(partial(git, "update-ref", "HEAD", old, head, cwd=work))
            git("read-tree", head, cwd=work)
            git("update-index", "-q", "--refresh", cwd=work, check=False)
        for keep in filter(None, kept):
            with contextlib.suppress(OSError):
                keep.unlink()
    for stale in paths.files_under(series.base.overlay):
        rel = stale.relative_to(series.base.overlay).as_posix()
        if rel not in series.touched:
            print(
                f"note: {stale} is in no patch; left in place for you to "
                "move into a patch or delete (`check` reports it)"
            )


def _replace(target: Path, data: bytes | None, undo: gitutil.Undo) -> Path | None:
    """Put `data` at `target` (None: remove it), registering in `undo`
    how to put it back; the hard link that keeps the old file until the
    step is over (removed after it), if there was one."""
    missing = [d for d in [target.parent, *target.parent.parents] if not d.exists()]
    for folder in reversed(missing):
        undo.append(partial(_remove, folder))
        folder.mkdir()
    new = target.with_name(f".{target.name}.patchset-new")
    keep = target.with_name(f".{target.name}.patchset-old")
    undo += [partial(_remove, new), partial(_remove, keep)]
    if data is None and not target.is_file():
        return None
    if data is not None:
        new.write_bytes(data)
    if not target.is_file():
        undo.append(partial(_remove, target))
        os.replace(new, target)
        return None
    _remove(keep)
    os.link(target, keep)
    undo.append(partial(os.replace, keep, target))
    if data is None:
        target.unlink()
    else:
        os.replace(new, target)
    return keep


def _remove(path: Path) -> None:
    """Remove the file `path`, or the folder if it is empty, where it is
    there (a read-only filesystem refuses even to remove what is not)."""
    if path.is_dir() and not path.is_symlink():
        if not any(path.iterdir()):
            path.rmdir()
    elif os.path.lexists(path):
        path.unlink()


def _note_untracked(work: Path) -> None:
    """Untracked files are never folded into a patch; say which are there."""
    untracked = git(
        "ls-files", "--others", "--exclude-standard", cwd=work
    ).stdout.splitlines()
    if untracked:
        shown = ", ".join(untracked[:5]) + (" ..." if len(untracked) > 5 else "")
        print(
            f"note: untracked files were not folded into any patch ({shown}); "
            "`git add` one and refresh again to make it part of a patch"
        )


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
