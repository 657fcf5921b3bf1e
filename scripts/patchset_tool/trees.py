# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The directories and files the tool writes: whose they are, who writes
them now, and whether what is on disk is what was written (README, Safety).

A Python installation is found at any depth, symlinks followed: below a
site-packages or dist-packages folder, in a venv (`pyvenv.cfg`) or conda
environment (`conda-meta`), or below a folder holding `*.dist-info`,
`*.egg-info` or `vllm/_version.py`. An existing file is refused unless the
tool recorded writing it (`record_file`) and it has not changed since. A
later run removes only marked staging folders that no live run holds. A tree
whose files do not match its manifest, or whose manifest cannot be read, is
not up to date, whatever its stamp says.
"""

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .digests import file_sha256
from .errors import PatchsetError, signals_held

MARKER = ".patchset-owned"
"""A tree the tool made holds this file (its content names the kind)."""
FILES = ".patchset-files"
"""In a folder the tool wrote single files into: each file's sha256 and name."""
MANIFEST = ".patchset-manifest"
STAGING = ".staging-"
"""A staging folder beside target T is named `.T.staging-XXXXXXXX`."""
SKIPPED_DIRS = {"__pycache__"}
INSTALL_DIRS = {"site-packages", "dist-packages"}
ENV_MARKS = ("pyvenv.cfg", "conda-meta")
UNCHANGED = "(nothing was changed)"


def mark(tree: Path, kind: str) -> None:
    """Mark `tree` (being built) as made by the tool."""
    (tree / MARKER).write_text(f"glm5next-patchset {kind}\n", encoding="utf-8")


def is_marked(tree: Path, markers: tuple[str, ...] = (MARKER,)) -> bool:
    return any((tree / marker).is_file() for marker in markers)


def marked_kind(tree: Path) -> str | None:
    """The kind `tree`'s marker names ("" for a marker without one), or None
    when it holds no marker."""
    try:
        text = (tree / MARKER).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return text.strip().removeprefix("glm5next-patchset").strip()


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


def _shown(path: Path, limit: int = 200) -> str:
    """`path` for a message, cut short when a user typed something huge."""
    text = str(path)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def installation_around(target: Path) -> str | None:
    """Why `target` (symlinks followed) lies in a Python installation, or
    None: a site-packages folder, a venv or conda environment, or a folder
    holding an installed distribution, at any depth above it."""
    where = target.resolve()
    if where.name in INSTALL_DIRS or any((where / m).exists() for m in ENV_MARKS):
        return f"{where} is a Python installation"
    for folder in where.parents:
        if folder.name in INSTALL_DIRS or any((folder / m).exists() for m in ENV_MARKS):
            return f"inside {folder}, a Python installation"
        if found := installed_package_in(folder):
            return f"inside {folder}, which holds an installed package ({found})"
    return None


def refuse_install(dest: Path, option: str) -> None:
    """Raise if `dest` lies in a Python installation (see
    `installation_around`)."""
    if why := installation_around(dest):
        raise PatchsetError(
            f"{_shown(dest)}: {why}; {option} must name a folder of your own "
            + UNCHANGED
        )


def claim_folder(
    dest: Path,
    option: str,
    kind: str | None = None,
    legacy: tuple[str, ...] = (),
) -> None:
    """The ownership rule for a folder the tool (re)makes: raise, one line,
    unless `dest` is absent or an empty directory, or a tree the tool made
    of the same `kind` (its marker names it; a `legacy` marker file of an
    older tool counts too); and never when it lies in a Python
    installation or is a symlink. `kind` None: replace no tree at all.
    Call it before writing anything."""
    refuse_install(dest, option)
    shown = _shown(dest)
    if dest.is_symlink():
        raise PatchsetError(
            f"{shown}: a symbolic link; {option} must name a real folder " + UNCHANGED
        )
    if not dest.exists():
        return
    if not dest.is_dir():
        raise PatchsetError(
            f"{shown}: exists and is not a directory the tool made; choose "
            f"another {option} " + UNCHANGED
        )
    found = marked_kind(dest)
    if kind is not None and (
        found == kind or (found is None and is_marked(dest, legacy))
    ):
        return
    if found is not None or is_marked(dest, legacy):
        what = found or "tree"
        raise PatchsetError(
            f"{shown}: holds the tool's {what}, which this command does not "
            f"replace; choose another {option} " + UNCHANGED
        )
    if found := installed_package_in(dest):
        raise PatchsetError(
            f"{shown}: holds an installed package ({found}); {option} must "
            "name a folder of your own " + UNCHANGED
        )
    if any(dest.iterdir()):
        raise PatchsetError(
            f"{shown}: a non-empty directory the tool did not make; remove it "
            f"yourself or choose another {option} " + UNCHANGED
        )


def refuse_foreign(dest: Path, option: str) -> None:
    """`claim_folder` for a command that replaces no tree: `dest` must be
    absent or an empty directory of the user's."""
    claim_folder(dest, option, kind=None)


def _recorded(folder: Path) -> dict[str, str]:
    """The sha256 (by name) of the files the tool recorded writing into `folder`."""
    try:
        text = (folder / FILES).read_text(encoding="utf-8")
    except (OSError, ValueError):
        return {}
    pairs = (line.split(" ", 1) for line in text.splitlines())
    return {name: digest for digest, name in (p for p in pairs if len(p) == 2)}


def claim_file(target: Path, option: str) -> None:
    """The ownership rule for a single file the tool writes: raise, one
    line, when `target` lies in a Python installation, is a symlink or
    not a regular file, or exists without being a file the tool recorded
    writing (`record_file`) with the same bytes since."""
    refuse_install(target, option)
    shown = _shown(target)
    if target.is_symlink() or (target.exists() and not target.is_file()):
        raise PatchsetError(
            f"{shown}: not a regular file; choose another {option} " + UNCHANGED
        )
    if not target.exists():
        return
    recorded = _recorded(target.parent).get(target.name)
    if recorded is None or recorded != file_sha256(target):
        raise PatchsetError(
            f"{shown}: a file the tool did not write"
            + (" (changed since it did)" if recorded else "")
            + f"; move it away or choose another {option} "
            + UNCHANGED
        )


def record_file(target: Path) -> None:
    """Remember that the tool wrote `target` as it is now (call after the
    file is complete), so that a later run may replace it."""
    records = _recorded(target.parent)
    records[target.name] = file_sha256(target)
    text = "".join(f"{digest} {name}\n" for name, digest in sorted(records.items()))
    (target.parent / FILES).write_text(text, encoding="utf-8")


def _holds_no_lock(marker: Path) -> bool:
    """Whether no live run holds the lock of the staging folder `marker`
    marks (its lock is the marker itself)."""
    try:
        with open(marker, "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def remove_stale(target: Path) -> None:
    """Remove the staging folders beside `target` that a killed run of
    the tool left: those it marked and that no live run holds. Anything
    else, whatever its name, is left alone."""
    for stale in target.parent.glob(f".{target.name}{STAGING}*"):
        marker = stale / MARKER
        if stale.is_symlink() or not stale.is_dir() or not marker.is_file():
            continue
        if marked_kind(stale) == "staging" and _holds_no_lock(marker):
            shutil.rmtree(stale, ignore_errors=True)


def make_staging(target: Path) -> Path:
    """A fresh hidden folder beside `target`, marked as a staging folder of
    the tool (absolute path): build in it, move the result out, and remove
    it (`shutil.rmtree`) on the way out. Call it holding `target`'s lock,
    or use `staging`, which also locks the folder itself."""
    parent = Path(os.path.abspath(target.parent))
    folder = Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING}", dir=parent))
    try:
        mark(folder, "staging")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


@contextlib.contextmanager
def staging(target: Path) -> Iterator[Path]:
    """`make_staging`, locked for as long as it is in use (no other run
    removes it as stale) and removed with whatever is left in it on the
    way out (an exception, or a signal the caller turned into one)."""
    folder = make_staging(target)
    try:
        with open(folder / MARKER, "rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield folder
    finally:
        remove(folder)


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A fresh folder in the temporary folder, removed on the way out."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        remove(folder)


def remove(folder: Path) -> None:
    """Remove `folder` whole: a signal meanwhile waits for it."""
    with signals_held():
        shutil.rmtree(folder, ignore_errors=True)


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
    (tree / MANIFEST).write_text("".join(lines), encoding="utf-8")


def _size(path: Path) -> int:
    return 0 if path.is_symlink() else path.stat().st_size


def damage(tree: Path) -> list[str]:
    """How `tree` differs from its manifest (empty: intact): every file
    hashed, every link's target read, no file the manifest does not list."""
    try:
        text = (tree / MANIFEST).read_text(encoding="utf-8")
    except OSError:
        return [f"{tree / MANIFEST}: missing (the tree was never completed)"]
    except ValueError:
        return [f"{tree / MANIFEST}: damaged (not UTF-8 text)"]
    problems = []
    listed = set()
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split(" ", 2)
        if len(fields) != 3 or not fields[1].isdigit() or not fields[2]:
            return [f"{tree / MANIFEST}:{number}: damaged (not a manifest line)"]
        fingerprint, size, rel = fields
        listed.add(rel)
        path = tree / rel
        if not path.is_symlink() and not path.is_file():
            problems.append(f"{rel}: missing")
        elif fingerprint.startswith("link:") or path.is_symlink():
            if _fingerprint(path) != fingerprint:
                problems.append(f"{rel}: link changed")
        elif _size(path) != int(size) or _fingerprint(path) != fingerprint:
            problems.append(f"{rel}: changed")
    problems += [
        f"{rel}: not in the manifest" for rel, _ in _entries(tree) if rel not in listed
    ]
    return problems
