# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset build`: one pip-installable vLLM wheel with a base's series.

The base's upstream wheel (fetched through pip, sha256-checked, cached) gets
the series applied to the Python files it touches with `apply`'s checks; every
other member is copied byte for byte (zipcopy.py). The result is vLLM
`<base>+glm5next.<series id>`, with `vllm/glm5next_series.json` naming the
series and RECORD regenerated; it is renamed into dist/ at the end.
"""

import contextlib
import csv
import errno
import io
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from . import apply, paths, trees
from .bases import Base
from .digests import file_sha256, record_hash
from .errors import PatchsetError
from .series import SERIES_FILE, Series
from .zipcopy import ZipCopier

WHEEL_TAGS = "cp38-abi3-manylinux_2_28_x86_64"
# pip's spelling of those tags, so the wheel is found from any host
PIP_PLATFORM = [
    "--only-binary=:all:",
    "--platform",
    "manylinux_2_28_x86_64",
    "--implementation",
    "cp",
    "--abi",
    "abi3",
]
PARTIAL_SUFFIX = ".partial"
DIST_KIND = "dist"
"""What the marker of a folder `build` wrote wheels into names."""
NEW_FILE_MODE = (stat.S_IFREG | 0o644) << 16


@dataclass(frozen=True)
class UpstreamWheel:
    """vLLM's own wheel for one release and the sha256 (hex) that the
    package index publishes for it."""

    path: Path
    sha256: str


@dataclass(frozen=True)
class BuiltWheel:
    path: Path
    size: int
    seconds: float
    base: Base
    patches: int
    files: int
    short_id: str

    def __str__(self) -> str:
        shown = shlex.quote(str(_display_path(self.path)))
        return (
            f"built {shown}\n"
            f"  {self.size / 1e6:.1f} MB in {self.seconds:.1f} s: vLLM "
            f"{self.base.version} ({self.base.commit}) with {self.patches} "
            f"patches (series {self.short_id}), {self.files} files changed\n"
            f"install it into a vLLM {self.base.version} environment (its "
            "dependencies stay as they are):\n"
            f"  uv pip install --no-deps {shown}\n"
            f"  pip install --no-deps {shown}"
        )


def _display_path(path: Path) -> Path:
    """`path` relative to the working directory when it lies below it."""
    cwd = Path.cwd()
    return path.relative_to(cwd) if path.is_relative_to(cwd) else path


# --- the upstream wheel -------------------------------------------------


def upstream_wheel_name(version: str) -> str:
    return f"vllm-{version}-{WHEEL_TAGS}.whl"


def wheel_cache() -> Path:
    """Where checked upstream wheels are kept, each with a `.sha256` file
    holding the index's digest."""
    return paths.cache_root() / "wheels"


def require_sha256(wheel: UpstreamWheel) -> None:
    """Raise unless the wheel's bytes hash to the index's sha256."""
    got = file_sha256(wheel.path)
    if got != wheel.sha256:
        raise PatchsetError(
            f"{wheel.path}: sha256 {got} is not the index's {wheel.sha256}; "
            "the file is damaged or not vLLM's own wheel. Delete it "
            f"(rm {wheel.path}) and run again to fetch it afresh"
        )


def upstream_wheel(version: str) -> UpstreamWheel:
    """VLLM's wheel for `version`: from the cache, or fetched once through
    pip and checked against the index's sha256 before it is kept.

    A cached wheel comes with the digest the index gave when it was
    fetched and is checked against it on every use; a damaged one is named
    and fetched again."""
    folder = wheel_cache()
    wheel = folder / upstream_wheel_name(version)
    digest_file = wheel.with_name(wheel.name + ".sha256")
    if wheel.is_file() and digest_file.is_file():
        cached = UpstreamWheel(wheel, digest_file.read_text(encoding="utf-8").strip())
        if file_sha256(wheel) == cached.sha256:
            return cached
        print(f"{wheel}: damaged (sha256 differs); fetching it again", file=sys.stderr)
    want = index_sha256(version)
    if wheel.is_file() and file_sha256(wheel) != want:
        wheel.unlink()
    if not wheel.is_file():
        _pip_download(version, want, folder)
    require_sha256(UpstreamWheel(wheel, want))
    digest_file.write_text(want + "\n", encoding="utf-8")
    return UpstreamWheel(wheel, want)


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    """Run this interpreter's pip, which reads pip's own configuration."""
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise PatchsetError(
            f"pip {args[0]} failed (exit {proc.returncode}); check the network "
            f"and pip's index configuration (`pip config list`).\npip said:\n{tail}"
        )
    return proc


def index_sha256(version: str) -> str:
    """The sha256 the configured index publishes for vLLM's wheel, asked of
    pip without downloading or building anything."""
    with tempfile.TemporaryDirectory(prefix="patchset-report-") as target:
        report = _pip(
            "install",
            "--dry-run",
            "--quiet",
            "--no-deps",
            "--ignore-installed",
            *PIP_PLATFORM,
            "--target",
            target,
            "--report",
            "-",
            f"vllm=={version}",
        ).stdout
    try:
        info = json.loads(report)["install"][0]["download_info"]
    except (ValueError, KeyError, IndexError) as exc:
        raise PatchsetError(f"pip gave no install report for vllm=={version}") from exc
    name = info["url"].rsplit("/", 1)[-1].split("#", 1)[0]
    digest = info.get("archive_info", {}).get("hashes", {}).get("sha256")
    if name != upstream_wheel_name(version) or not digest:
        raise PatchsetError(
            f"the index offers {name} for vllm=={version}"
            + ("" if digest else " without a sha256")
            + f"; the build needs {upstream_wheel_name(version)} and its sha256"
        )
    return str(digest)


@contextlib.contextmanager
def _download_dir(folder: Path, name: str) -> Iterator[str]:
    """A fresh download folder for `name` (hold its lock), after removing
    the ones a killed download left."""
    for stale in folder.glob(f".download-{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f".download-{name}-", dir=folder) as tmp:
        yield tmp


def _pip_download(version: str, sha256: str, folder: Path) -> None:
    """Download the wheel into `folder` with pip, which refuses any other
    sha256; a failure keeps nothing (what a killed download left is
    removed first)."""
    name = upstream_wheel_name(version)
    print(f"fetching {name} with pip (once; kept in {folder})", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    with trees.locked(folder / name), _download_dir(folder, name) as tmp:
        pinned = Path(tmp) / "requirement.txt"
        pinned.write_text(f"vllm=={version} --hash=sha256:{sha256}\n", encoding="utf-8")
        _pip(
            "download",
            "--no-deps",
            "--require-hashes",
            "--progress-bar",
            "off",
            *PIP_PLATFORM,
            "--dest",
            tmp,
            "-r",
            str(pinned),
        )
        fetched = Path(tmp) / name
        if not fetched.is_file():
            raise PatchsetError(f"pip download left no {name}")
        os.replace(fetched, folder / name)


# --- reading the upstream wheel ------------------------------------------


def _dist_info(source: zipfile.ZipFile, base: Base) -> str:
    """The upstream wheel's dist-info folder; raise unless it is `base`'s."""
    folder = f"vllm-{base.version}.dist-info"
    if f"{folder}/RECORD" not in source.namelist():
        raise PatchsetError(f"{source.filename}: has no {folder}/RECORD")
    return folder


def _wheel_record(source: zipfile.ZipFile, dist_info: str) -> dict[str, str]:
    """Path to RECORD hash, for every hashed entry of the wheel's RECORD."""
    text = source.read(f"{dist_info}/RECORD").decode()
    return {row[0]: row[1] for row in csv.reader(io.StringIO(text)) if row[1:2] != [""]}


def _require_commit(source: zipfile.ZipFile, base: Base) -> None:
    """Raise unless the wheel's vllm/_version.py names `base`'s commit."""
    version_file = source.read("vllm/_version.py").decode()
    if f"g{base.commit}" not in version_file:
        raise PatchsetError(
            f"{source.filename}: vllm/_version.py does not name commit "
            f"{base.commit}, which bases.toml declares for vLLM {base.version}"
        )


def _pristine_files(
    source: zipfile.ZipFile, record: dict[str, str], series: Series
) -> dict[str, bytes]:
    """The upstream bytes of every file the series modifies, each proven
    against the wheel's RECORD; raise naming every file that cannot be."""
    wanted, problems = {}, []
    names = set(source.namelist())
    for path, existed in series.touched.items():
        if not path.startswith("vllm/"):
            continue  # not in the wheel; `apply.write_source_files` brings it
        if not existed:
            if path in names:
                problems.append(
                    f"{series.creator(path)}: creates {path}, which the wheel has"
                )
            continue
        if path not in record:
            problems.append(f"{path}: not listed in the wheel's RECORD")
            continue
        data = source.read(path)
        if record_hash(data) != record[path]:
            problems.append(f"{path}: differs from the sha256 in the wheel's RECORD")
        wanted[path] = data
    if problems:
        raise PatchsetError(
            f"{source.filename} is not the base the series applies to:\n  "
            + "\n  ".join(problems)
        )
    return wanted


def _patched_files(source: zipfile.ZipFile, series: Series) -> dict[str, bytes]:
    """The vllm/ files the series writes, path to bytes, after applying it
    to the checked upstream files and matching the result to the overlay."""
    record = _wheel_record(source, _dist_info(source, series.base))
    pristine = _pristine_files(source, record, series)
    with tempfile.TemporaryDirectory(prefix="patchset-wheel-") as tmp:
        root = Path(tmp)
        for path, data in pristine.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)
        # The wheel ships vllm/ alone: upstream's tests and docs stay out.
        apply.apply_series_in(root, series, skip=series.source_files)
        return {
            path: (root / path).read_bytes()
            for path in series.touched
            if path.startswith("vllm/")
        }


# --- writing the wheel ----------------------------------------------------


def metadata_with_version(metadata: bytes, version: str) -> bytes:
    """METADATA with the `Version:` header of its header block set to
    `version`; every other byte (line endings, body) is kept."""
    lines = metadata.split(b"\n")
    end = next((i for i, line in enumerate(lines) if line in (b"", b"\r")), len(lines))
    found = [i for i in range(end) if lines[i].startswith(b"Version:")]
    if len(found) != 1:
        raise PatchsetError(f"METADATA has {len(found)} Version: headers, not one")
    ending = b"\r" if lines[found[0]].endswith(b"\r") else b""
    lines[found[0]] = b"Version: " + version.encode() + ending
    return b"\n".join(lines)


def _entry(name: str, like: zipfile.ZipInfo) -> zipfile.ZipInfo:
    """A new zip entry named `name` with `like`'s date and mode (ZipCopier
    deflates it and sets its size and CRC)."""
    info = zipfile.ZipInfo(name, like.date_time)
    info.external_attr = like.external_attr
    return info


class _WheelWriter:
    """Writes wheel members and remembers the RECORD line of each."""

    def __init__(self, out: ZipCopier, upstream_record: dict[str, str]) -> None:
        self.out = out
        self.upstream_record = upstream_record
        self.record: list[tuple[str, str, str]] = []

    def write(self, info: zipfile.ZipInfo, data: bytes) -> None:
        self.out.add(info, data)
        digest = record_hash(data)
        self.record.append((info.filename, digest, str(len(data))))

    def copy(
        self, source: zipfile.ZipFile, raw: BinaryIO, info: zipfile.ZipInfo, name: str
    ) -> None:
        """Copy one member's compressed bytes unchanged (`raw`: the source
        archive's file). Its RECORD hash is upstream's, whose wheel matched
        the index's sha256; a member upstream lists without one is hashed."""
        digest = self.upstream_record.get(info.filename)
        if digest is None:
            digest = record_hash(source.read(info))
        self.out.copy(raw, info, name)
        self.record.append((name, digest, str(info.file_size)))

    def write_record(self, name: str, like: zipfile.ZipInfo) -> None:
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerows([*self.record, (name, "", "")])
        self.out.add(_entry(name, like), text.getvalue().encode())


def _write_wheel(
    source: zipfile.ZipFile,
    raw: BinaryIO,
    target: Path,
    base: Base,
    version: str,
    replaced: dict[str, bytes],
) -> None:
    """Write the patched wheel to `target`: upstream's members in order
    with the series' files replaced, its new files and the series file
    after them, then the renamed dist-info with RECORD last. `raw` is the
    upstream archive's file, whose members are copied still compressed."""
    old_dist = _dist_info(source, base)
    new_dist = f"vllm-{version}.dist-info"
    stamp = source.getinfo(f"{old_dist}/METADATA")
    dist_members = []
    with open(target, "wb") as out:
        wheel = _WheelWriter(ZipCopier(out), _wheel_record(source, old_dist))
        for info in source.infolist():
            if info.filename.startswith(old_dist + "/"):
                dist_members.append(info)
            elif info.filename in replaced:
                data = replaced[info.filename]
                wheel.write(_entry(info.filename, info), data)
            else:
                wheel.copy(source, raw, info, info.filename)
        for name in sorted(set(replaced) - set(source.namelist())):
            wheel.write(_new_entry(name, stamp), replaced[name])
        for info in dist_members:
            name = new_dist + info.filename.removeprefix(old_dist)
            if info.filename == f"{old_dist}/METADATA":
                data = metadata_with_version(source.read(info), version)
                wheel.write(_entry(name, info), data)
            elif info.filename != f"{old_dist}/RECORD":
                wheel.copy(source, raw, info, name)
        wheel.write_record(f"{new_dist}/RECORD", stamp)
        wheel.out.close()


def _new_entry(name: str, stamp: zipfile.ZipInfo) -> zipfile.ZipInfo:
    """An entry for a file the series adds: mode 644, upstream's date."""
    info = _entry(name, stamp)
    info.external_attr = NEW_FILE_MODE
    return info


def _write_atomically(target: Path, write: Callable[[Path], None], need: int) -> None:
    """Call `write` on a file in a fresh staging folder beside `target`
    (`trees.staging`), then rename it into place and mark the folder as
    the tool's. On any failure or stopping signal the staging folder is
    removed, and so is the folder when this call created it; an OSError
    becomes a PatchsetError that names the folder (`need`: bytes the write
    takes, for the message)."""
    folder = target.parent
    created = not folder.exists()
    marked = trees.is_marked(folder)
    with contextlib.ExitStack() as stack:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            work = stack.enter_context(trees.staging(target))
        except OSError as exc:
            if created:
                shutil.rmtree(folder, ignore_errors=True)
            raise PatchsetError(
                f"cannot write the wheel to {folder}: {exc.strerror}; "
                "choose a writable --dist"
            ) from exc
        partial = work / (target.name + PARTIAL_SUFFIX)
        try:
            write(partial)
            with open(partial, "rb") as handle:
                os.fsync(handle.fileno())
            os.chmod(partial, 0o666 & ~trees.umask())
            if not marked:
                trees.mark(folder, DIST_KIND)
            os.replace(partial, target)
        except BaseException as exc:
            stack.close()
            if created:
                shutil.rmtree(folder, ignore_errors=True)
            elif not marked:
                (folder / trees.MARKER).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise PatchsetError(_write_failure(exc, folder, need)) from exc
            raise


def claim_dist(dist: Path) -> None:
    """Raise unless `build` may write into `dist` (the ownership rule,
    `trees.claim_folder`): absent, empty, or a dist folder it made."""
    trees.claim_folder(dist, "--dist", kind=DIST_KIND)


def _write_failure(exc: OSError, folder: Path, need: int) -> str:
    if exc.errno == errno.ENOSPC:
        free = shutil.disk_usage(folder).free if folder.exists() else 0
        return (
            f"no space left on the device of {folder} while writing the wheel "
            f"(about {need / 1e6:.0f} MB needed, {free / 1e6:.0f} MB free); "
            "nothing was left there. Free space or choose another --dist"
        )
    return f"writing the wheel to {folder} failed: {exc}; nothing was left there"


def build_wheel(series: Series, upstream: UpstreamWheel, dist: Path) -> BuiltWheel:
    """Write the wheel of vLLM with `series` into `dist` and
    return what was built.

    Raises PatchsetError, leaving nothing in `dist`, when the upstream
    wheel's bytes do not hash to `upstream.sha256`, when it is not the
    base (dist-info, commit, RECORD of a touched file), when the series
    does not apply or disagrees with the overlay, or when `dist` cannot
    take the wheel."""
    start = time.monotonic()
    base = series.base
    if not series.patches:
        raise PatchsetError(f"{base.series_file}: the series is empty")
    require_sha256(upstream)
    version = series.version
    with zipfile.ZipFile(upstream.path) as source, open(upstream.path, "rb") as raw:
        _require_commit(source, base)
        replaced = _patched_files(source, series)
        replaced[SERIES_FILE] = series.manifest()
        target = dist.resolve() / f"vllm-{version}-{WHEEL_TAGS}.whl"
        claim_dist(dist)
        if target.parent.is_dir():
            trees.remove_stale(target)  # what a killed build left
        print(f"writing {target.name}", flush=True)
        _write_atomically(
            target,
            lambda partial: _write_wheel(source, raw, partial, base, version, replaced),
            upstream.path.stat().st_size,
        )
    return BuiltWheel(
        target,
        target.stat().st_size,
        time.monotonic() - start,
        base,
        len(series.patches),
        len(replaced) - 1,
        series.short_id,
    )
