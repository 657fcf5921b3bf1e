# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The directories the tool writes: whose they are, who writes them now,
and whether what is on disk is what was written.

- Ownership: a tree the tool makes carries a marker file; the tool
  replaces a destination only when it is absent, an empty directory or
  marked as its own, and never one inside a Python environment or
  holding an installed package. Every refusal comes before anything is
  removed.
- Locking: one `flock` per tree, on a hidden lock file beside it, held
  for the whole of a write; a second run waits, saying so.
- Content: a manifest of every file (sha256, or a link's target) is
  written last into the tree; a tree whose files do not match it is not
  "up to date", whatever its stamp says.
"""

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from .digests import file_sha256
from .errors import PatchsetError

MARKER = ".patchset-owned"
"""A tree the tool made holds this file (its content names the kind)."""
MANIFEST = ".patchset-manifest"
SKIPPED_DIRS = {"__pycache__"}
INSTALL_DIRS = {"site-packages", "dist-packages"}


def mark(tree: Path, kind: str) -> None:
    """Mark `tree` (being built) as made by the tool."""
    (tree / MARKER).write_text(f"glm5next-patchset {kind}\n")


def is_marked(tree: Path, markers: tuple[str, ...] = (MARKER,)) -> bool:
    return any((tree / marker).is_file() for marker in markers)


def installed_package_in(folder: Path) -> str | None:
    """What in `folder` shows an installed distribution, if anything."""
    try:
        for entry in folder.iterdir():
            if entry.suffix in (".dist-info", ".egg-info") and entry.is_dir():
                return entry.name
    except OSError:
        return None
    if (folder / "vllm" / "_version.py").is_file():
        return "vllm/_version.py"
    return None


def refuse_install(dest: Path, option: str) -> None:
    """Raise if `dest` lies in a Python installation: below a site-packages,
    in a venv, or beside an installed package."""
    where = dest.resolve()
    for folder in where.parents:
        if folder.name in INSTALL_DIRS or (folder / "pyvenv.cfg").is_file():
            raise PatchsetError(
                f"{dest}: inside {folder}, a Python installation; {option} "
                "must name a folder of your own (nothing was changed)"
            )
    if where.name in INSTALL_DIRS or (where / "pyvenv.cfg").is_file():
        raise PatchsetError(
            f"{dest}: a Python installation; {option} must name a folder of "
            "your own (nothing was changed)"
        )
    if found := installed_package_in(where.parent):
        raise PatchsetError(
            f"{dest}: {where.parent} holds an installed package ({found}); "
            f"{option} must name a folder of your own (nothing was changed)"
        )


def refuse_foreign(
    dest: Path, option: str, markers: tuple[str, ...] = (MARKER,)
) -> None:
    """Raise unless the tool may replace `dest`: it is absent, an empty
    directory, or a tree the tool made (one of `markers` in it); and it is not in
    a Python installation."""
    refuse_install(dest, option)
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_symlink() or not dest.is_dir():
        raise PatchsetError(
            f"{dest}: exists and is not a directory the tool made; choose "
            f"another {option} (nothing was changed)"
        )
    if is_marked(dest, markers):
        return
    if found := installed_package_in(dest):
        raise PatchsetError(
            f"{dest}: holds an installed package ({found}); {option} must "
            "name a folder of your own (nothing was changed)"
        )
    if any(dest.iterdir()):
        raise PatchsetError(
            f"{dest}: a non-empty directory the tool did not make; remove it "
            f"yourself or choose another {option} (nothing was changed)"
        )


def umask() -> int:
    """The process's umask (what a file the user makes is masked with)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def lock_path(tree: Path) -> Path:
    return tree.with_name(f".{tree.name}.lock")


@contextlib.contextmanager
def locked(tree: Path) -> Iterator[None]:
    """Hold the lock of `tree` (exclusive); wait, saying so, while another
    run of the tool holds it."""
    tree.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(tree), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(
                f"waiting for another patchset run writing {tree} to finish...",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _entries(tree: Path) -> Iterator[tuple[str, Path]]:
    """(relative path, path) of every file and link under `tree`, but the
    bytecode caches and the manifest itself, in a stable order."""
    for folder, dirs, files in os.walk(tree):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]
        for name in sorted(files + links):
            path = Path(folder, name)
            rel = path.relative_to(tree).as_posix()
            if rel != MANIFEST:
                yield rel, path


def _fingerprint(path: Path) -> str:
    if path.is_symlink():
        return "link:" + os.readlink(path)
    return file_sha256(path)


def write_manifest(tree: Path) -> None:
    """Record every file of `tree` (call last, once the tree is complete)."""
    lines = [
        f"{_fingerprint(path)} {_size(path)} {rel}\n" for rel, path in _entries(tree)
    ]
    (tree / MANIFEST).write_text("".join(lines))


def _size(path: Path) -> int:
    return 0 if path.is_symlink() else path.stat().st_size


def damage(tree: Path, full: bool = True) -> list[str]:
    """How `tree` differs from its manifest (empty: intact). `full` hashes
    every file; otherwise presence, size and link targets are compared."""
    try:
        text = (tree / MANIFEST).read_text()
    except OSError:
        return [f"{tree / MANIFEST}: missing (the tree was never completed)"]
    problems = []
    listed = set()
    for line in text.splitlines():
        fingerprint, size, rel = line.split(" ", 2)
        listed.add(rel)
        path = tree / rel
        if not path.is_symlink() and not path.is_file():
            problems.append(f"{rel}: missing")
        elif fingerprint.startswith("link:") or path.is_symlink():
            if _fingerprint(path) != fingerprint:
                problems.append(f"{rel}: link changed")
        elif _size(path) != int(size) or (full and _fingerprint(path) != fingerprint):
            problems.append(f"{rel}: changed")
    if full:
        problems += [
            f"{rel}: not in the manifest"
            for rel, _ in _entries(tree)
            if rel not in listed
        ]
    return problems
