# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Applying the series: to a copy of the installed package, or to a checkout.

Package mode never writes into the installed vLLM. It verifies every base
file the series touches against RECORD, builds the patched copy in a
staging directory next to the destination, checks the result against the
overlay, and only then renames it into place: an interrupted or failed
apply leaves the previous tree (or none), never a half-patched one.
"""

import hashlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from . import gitutil, paths, trees, upstream
from .bases import Base
from .distinfo import InstalledVllm, check_base, default_install
from .errors import PatchsetError
from .series import Series

STAMP = ".patchset-stamp.json"
KIND = "patched-tree"
"""What a patched tree's marker names (one holding STAMP alone was made
by an older tool)."""
KILL_AFTER_VAR = "PATCHSET_TEST_KILL_AFTER"


@dataclass
class Summary:
    base: Base
    patches: int
    files: int
    hunks: int
    verified_base: int
    seconds: float
    dest: Path | None
    up_to_date: bool = False

    def __str__(self) -> str:
        where = f"into {self.dest}" if self.dest else "(--check: nothing written)"
        if self.up_to_date:
            where = f"in {self.dest}, already up to date"
        return (
            f"vLLM {self.base.version}: applied {self.patches} patches, "
            f"{self.files} files, {self.hunks} hunks {where}; "
            f"{self.verified_base} base files match RECORD; result equals "
            f"{self.base.overlay.relative_to(paths.REPO)}/; "
            f"{self.seconds:.2f} s"
        )


def series_digest(install: InstalledVllm, series: Series) -> str:
    """What a patched tree was built from: the series, the patches, the
    overlay and the base install."""
    base = series.base
    h = hashlib.sha256(str(install.site).encode())
    h.update(base.series_file.read_bytes())
    for patch in series.patches:
        h.update(patch.path.read_bytes())
    for path in paths.files_under(base.overlay):
        h.update(str(path.relative_to(base.overlay)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _copy_package(install: InstalledVllm, staging: Path) -> None:
    """Copy the installed package into `staging`, linking extensions.

    Bytecode caches are left behind: `run` lets Python write fresh ones into
    the patched tree on first import."""

    def copy(src: str, dst: str) -> None:
        if src.endswith(".so"):
            os.symlink(src, dst)
        else:
            shutil.copyfile(src, dst)

    shutil.copytree(
        install.package,
        staging / "vllm",
        copy_function=copy,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copytree(install.dist_info, staging / install.dist_info.name)


def apply_series_in(root: Path, series: Series, skip: Collection[str] = ()) -> None:
    """Apply `series` to the copy of vLLM's files under `root` (which
    holds `vllm/`), leaving out the paths in `skip`, and prove the result
    equals the base's overlay; raise naming the patch, file and hunk that
    fail."""
    apply_patches(series, root, skip)
    _compare_with_overlay(series, root, skip)


def apply_patches(series: Series, staging: Path, skip: Collection[str] = ()) -> None:
    """`git apply` each patch of `series`, in order, to the files under
    `staging` (but those in `skip`), as patch(1) would; raise naming the
    patch, file and hunk."""
    env = gitutil.outside_repo_env(staging)
    kill_after = os.environ.get(KILL_AFTER_VAR)
    excludes = [f"--exclude={path}" for path in skip]
    for number, patch in enumerate(series.patches, 1):
        proc = gitutil.git(
            "apply",
            "--whitespace=nowarn",
            *excludes,
            str(patch.path),
            cwd=staging,
            env=env,
            check=False,
        )
        if proc.returncode:
            raise PatchsetError(
                gitutil.explain_failure(patch, proc.stderr)
                + f"\ngit apply said:\n{proc.stderr.strip()}"
            )
        if kill_after == str(number):
            os.kill(os.getpid(), signal.SIGKILL)


def _compare_with_overlay(
    series: Series, staging: Path, skip: Collection[str] = ()
) -> None:
    """The applied result must equal the base's overlay, file for file
    (but those in `skip`)."""
    problems = []
    base, touched = series.base, series.touched
    for path in touched:
        if path in skip:
            continue
        reference = base.copy_of(path)
        result = staging / path
        if not reference.is_file():
            problems.append(
                f"{path}: the series changes it, but {reference} is missing"
            )
        elif result.read_bytes() != reference.read_bytes():
            problems.append(f"{path}: the series' result differs from {reference}")
    for extra in paths.files_under(base.overlay):
        rel = extra.relative_to(base.overlay).as_posix()
        if rel not in touched:
            problems.append(f"{extra}: no patch in the series changes it")
    if problems:
        raise PatchsetError(
            "series and overlay disagree:\n  "
            + "\n  ".join(problems)
            + "\n(after editing, regenerate with `scripts/patchset refresh N`)"
        )


def _writable_parent(dest: Path) -> None:
    """Raise if `dest`'s parent cannot take new entries (probed, since root
    ignores permission bits)."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".probe-"):
            pass
    except OSError as exc:
        raise PatchsetError(
            f"cannot write the patched tree to {dest}: {exc.strerror} "
            f"({dest.parent}); choose a writable --dest"
        ) from exc


def apply_to_package(
    base: Base,
    dest: Path | None,
    install: InstalledVllm | None = None,
    force: bool = False,
) -> Summary:
    """Materialize `base`'s patched package at `dest` (None: check only)."""
    start = time.monotonic()
    gitutil.git_exe()
    install = install or default_install(base)
    series = Series.load(base)
    existing = check_base(install, series)
    summary = Summary(
        base,
        len(series.patches),
        len(series.touched),
        series.hunks,
        len(existing),
        0.0,
        dest,
    )
    if dest is None:
        staging = Path(tempfile.mkdtemp(prefix="patchset-check-"))
        try:
            _build(install, series, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        summary.seconds = time.monotonic() - start
        return summary
    claim_tree(dest)
    _writable_parent(dest)
    with trees.locked(dest):
        trees.remove_stale(dest)  # what a killed apply left behind
        claim_tree(dest)  # again: another run may have written it meanwhile
        if not force and _is_current(dest, install, series):
            _compare_with_overlay(series, dest)
            summary.up_to_date = True
        else:
            with trees.staging(dest) as work:
                staging = work / "tree"
                staging.mkdir()
                _build(install, series, staging)
                stamp = {
                    "digest": series_digest(install, series),
                    "vllm": base.version,
                    "base": str(install.site),
                    "patches": [p.name for p in series.patches],
                }
                trees.mark(staging, KIND)
                (staging / STAMP).write_text(
                    json.dumps(stamp, indent=1) + "\n", encoding="utf-8"
                )
                trees.write_manifest(staging)  # last: the tree is complete
                _swap_into_place(staging, dest, work / "old")
    summary.seconds = time.monotonic() - start
    return summary


def claim_tree(dest: Path) -> None:
    """Raise unless `apply` may (re)make its patched tree at `dest` (the
    ownership rule, `trees.claim_folder`)."""
    trees.claim_folder(dest, "--dest", kind=KIND, legacy=(STAMP,))


def _build(install: InstalledVllm, series: Series, staging: Path) -> None:
    """The patched package in `staging`, proven equal to the overlay."""
    os.chmod(staging, 0o777 & ~trees.umask())  # mkdtemp made it 0700
    _copy_package(install, staging)
    write_source_files(staging, series)
    apply_series_in(staging, series)


def write_source_files(root: Path, series: Series) -> None:
    """Put under `root` the release's copy of each base file the series
    changes that the wheel does not ship (upstream's tests, docs)."""
    files = upstream.release_files(series.base.version, series.source_files)
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


def _swap_into_place(staging: Path, dest: Path, old: Path) -> None:
    """Rename `staging` to `dest`; the tree it replaces goes to `old`
    (inside the run's own staging folder, removed with it)."""
    if dest.exists():
        dest.rename(old)
    staging.rename(dest)


def is_current(dest: Path, install: InstalledVllm, base: Base) -> bool:
    """Whether `dest` was built from `base`'s current series and install,
    and still holds every file its manifest lists, with the same sha256
    (an edited file of the same size is stale too)."""
    return _is_current(dest, install, Series.load(base))


def _is_current(dest: Path, install: InstalledVllm, series: Series) -> bool:
    """`is_current` for a loaded series."""
    try:
        stamp = json.loads((dest / STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if stamp.get("digest") != series_digest(install, series):
        return False
    return not trees.damage(dest)


def report_tree(base: Base, dest: Path) -> int:
    """For `apply --check`: say whether the patched tree at `dest` is
    intact (every file as its manifest says); 1 when it is damaged."""
    if not dest.exists():
        print(f"{dest}: no patched tree yet; `scripts/patchset apply` makes it")
        return 0
    problems = trees.damage(dest)
    if not problems:
        print(f"{dest}: intact ({trees.MANIFEST} matches every file)")
        return 0
    shown = "\n  ".join(problems[:10])
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    print(
        f"{dest}: damaged, {len(problems)} file(s) differ from its manifest:\n  "
        f"{shown}{more}\n`scripts/patchset apply --base {base.version}` rebuilds it"
    )
    return 1


def apply_to_checkout(
    series: Series, src: Path, check: bool, other_release: bool = False
) -> tuple[int, float]:
    """`git am -3` `series` onto a vLLM checkout (in a scratch clone; then,
    unless `check`, fast-forward `src` to the result in one uninterruptible
    step); return (patches, seconds). A checkout of another release is
    refused unless `other_release`."""
    start = time.monotonic()
    gitutil.require_clean_checkout(src)
    if why := gitutil.other_release(src, series.base):
        if not other_release:
            raise PatchsetError(
                f"{why}; pass --base with its release, or --other-release to "
                "three-way merge the series onto it anyway (nothing was changed)"
            )
        print(f"note: {why}; merging the series onto it (--other-release)")
    with gitutil.scratch_clone(src) as scratch:
        gitutil.am_series(scratch, series.patches)
        if not check:
            old = gitutil.git("rev-parse", "HEAD", cwd=src).stdout.strip()
            head = gitutil.git("rev-parse", "HEAD", cwd=scratch).stdout.strip()
            with gitutil.publishing(f"the series' commits on {src}") as undo:
                gitutil.fetch_commits(src, scratch, [head])
                gitutil.fast_forward(src, old, head, undo)
    return len(series.patches), time.monotonic() - start
