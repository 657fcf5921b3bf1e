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
from dataclasses import dataclass
from pathlib import Path

from . import envmgr, gitutil, paths, trees
from .bases import Base
from .distinfo import InstalledVllm, find_base_install
from .errors import PatchsetError
from .series import Patch, load_series

STAMP = ".patchset-stamp.json"
OWNED = (trees.MARKER, STAMP)
"""A patched tree holds one of these (STAMP alone: made by an older tool)."""
KILL_AFTER_VAR = "PATCHSET_TEST_KILL_AFTER"
SITE_VAR = "GLM5NEXT_PATCHSET_SITE"


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


def touched_files(patches: list[Patch]) -> dict[str, bool]:
    """Every path the series touches, mapped to whether it existed before."""
    first_touch: dict[str, bool] = {}
    for patch in patches:
        for diff in patch.files:
            first_touch.setdefault(diff.path, not diff.is_new)
    return first_touch


def series_digest(install: InstalledVllm, base: Base) -> str:
    """What a patched tree was built from: the series, the patches, the
    overlay and the base install."""
    h = hashlib.sha256(str(install.site).encode())
    h.update(base.series_file.read_bytes())
    for patch in load_series(base.patches):
        h.update(patch.path.read_bytes())
    for path in paths.files_under(base.overlay):
        h.update(str(path.relative_to(base.overlay)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def default_install(base: Base) -> InstalledVllm:
    """The install `base`'s series applies to: its managed environment's,
    or the site-packages named by GLM5NEXT_PATCHSET_SITE (a copy under
    test)."""
    override = os.environ.get(SITE_VAR)
    if override:
        return find_base_install(Path(override), base)
    python = envmgr.env_python(base)
    assert python is not None
    return find_base_install(envmgr.site_packages(python), base)


def check_base(install: InstalledVllm, patches: list[Patch]) -> list[str]:
    """Verify the base files; return the vllm/ paths that must pre-exist."""
    existing, problems = [], []
    for path, existed in touched_files(patches).items():
        in_wheel = path.startswith("vllm/")
        if existed and in_wheel:
            existing.append(path)
        elif existed:
            problems.append(
                f"{path}: modified by the series but not shipped "
                "in the wheel; use --vllm-src"
            )
        elif in_wheel and (install.site / path).exists():
            creator = next(p.name for p in patches if p.file(path))
            problems.append(
                f"{creator}: creates {path}, which already exists in {install.site}"
            )
    if problems:
        raise PatchsetError("the series cannot apply here:\n  " + "\n  ".join(problems))
    install.verify(existing)
    return existing


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


def apply_series_in(root: Path, base: Base) -> None:
    """Apply `base`'s series to the copy of vLLM's files under `root` (which
    holds `vllm/`) and prove the result equals the base's overlay; raise
    naming the patch, file and hunk that fail."""
    patches = load_series(base.patches)
    _apply_patches(patches, root)
    _compare_with_overlay(patches, root, base)


def _apply_patches(patches: list[Patch], staging: Path) -> None:
    env = gitutil.outside_repo_env(staging)
    kill_after = os.environ.get(KILL_AFTER_VAR)
    for number, patch in enumerate(patches, 1):
        proc = gitutil.git(
            "apply",
            "--whitespace=nowarn",
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


def _compare_with_overlay(patches: list[Patch], staging: Path, base: Base) -> None:
    """The applied result must equal the base's overlay, file for file."""
    problems = []
    touched = touched_files(patches)
    for path in touched:
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


def remove_stale_staging(dest: Path) -> None:
    for stale in dest.parent.glob(f".{dest.name}.staging-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in dest.parent.glob(f".{dest.name}.old-*"):
        shutil.rmtree(stale, ignore_errors=True)


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
    patches = load_series(base.patches)
    existing = check_base(install, patches)
    summary = Summary(
        base,
        len(patches),
        len(touched_files(patches)),
        sum(p.hunks for p in patches),
        len(existing),
        0.0,
        dest,
    )
    if dest is None:
        staging = Path(tempfile.mkdtemp(prefix="patchset-check-"))
        try:
            _build(install, patches, base, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        summary.seconds = time.monotonic() - start
        return summary
    trees.refuse_foreign(dest, "--dest", OWNED)
    _writable_parent(dest)
    with trees.locked(dest):
        remove_stale_staging(dest)  # what a killed apply left behind
        if not force and is_current(dest, install, base, full=True):
            _compare_with_overlay(patches, dest, base)
            summary.up_to_date = True
        else:
            staging = Path(
                tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent)
            )
            try:
                _build(install, patches, base, staging)
                stamp = {
                    "digest": series_digest(install, base),
                    "vllm": base.version,
                    "base": str(install.site),
                    "patches": [p.name for p in patches],
                }
                trees.mark(staging, "patched-tree")
                (staging / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
                trees.write_manifest(staging)  # last: the tree is complete
                _swap_into_place(staging, dest)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    summary.seconds = time.monotonic() - start
    return summary


def _build(
    install: InstalledVllm, patches: list[Patch], base: Base, staging: Path
) -> None:
    """The patched package in `staging`, proven equal to the overlay."""
    os.chmod(staging, 0o777 & ~trees.umask())  # mkdtemp made it 0700
    _copy_package(install, staging)
    _apply_patches(patches, staging)
    _compare_with_overlay(patches, staging, base)


def _swap_into_place(staging: Path, dest: Path) -> None:
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        dest.rename(old)
    staging.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def is_current(
    dest: Path, install: InstalledVllm, base: Base, full: bool = False
) -> bool:
    """Whether `dest` was built from `base`'s current series and install,
    and still holds every file its manifest lists (`full`: with the same
    sha256; otherwise the same size)."""
    try:
        stamp = json.loads((dest / STAMP).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("digest") != series_digest(install, base):
        return False
    return not trees.damage(dest, full=full)


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


def apply_to_checkout(base: Base, src: Path, check: bool) -> tuple[int, float]:
    """`git am -3` `base`'s series onto a vLLM checkout (check: in a scratch
    worktree, leaving `src` alone); return (patches, seconds)."""
    start = time.monotonic()
    patches = load_series(base.patches)
    gitutil.require_clean_checkout(src)
    if check:
        with scratch_worktree(src) as scratch:
            gitutil.am_series(scratch, patches)
    else:
        gitutil.am_series(src, patches)
    return len(patches), time.monotonic() - start


class scratch_worktree:
    """A detached worktree of `src` at HEAD, removed on exit."""

    def __init__(self, src: Path, branch: str | None = None) -> None:
        self.src, self.branch = src, branch
        self.path = Path(tempfile.mkdtemp(prefix="patchset-worktree-"))

    def __enter__(self) -> Path:
        self.path.rmdir()
        args = ["-b", self.branch] if self.branch else ["--detach"]
        gitutil.git(
            "worktree", "add", "--quiet", *args, str(self.path), "HEAD", cwd=self.src
        )
        return self.path

    def __exit__(self, *exc: object) -> None:
        gitutil.git(
            "worktree", "remove", "--force", str(self.path), cwd=self.src, check=False
        )
        shutil.rmtree(self.path, ignore_errors=True)
        gitutil.git("worktree", "prune", cwd=self.src, check=False)
