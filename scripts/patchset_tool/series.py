# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A base's series: the `series` file, its `git format-patch` mbox
patches, and what follows from them (the files they touch and create,
the blob chain, the series' identity and the manifest a wheel carries)."""

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from . import paths
from .bases import Base
from .digests import file_sha256
from .errors import PatchsetError

SERIES_FILE = "vllm/glm5next_series.json"
"""Where a patched wheel names its series (`Series.manifest`)."""
LOCAL_LABEL = "glm5next"
SHORT_ID_LENGTH = 10

MBOX_FROM = re.compile(r"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$")
PATCH_NAME = re.compile(r"^\d{4}-[A-Za-z0-9._-]+\.patch$")
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)")
AUTHOR = re.compile(r"^[^<>\s][^<>]*<[^<>@\s]+@[^<>\s]+>$")
"""A `From:` header `git am` takes: `Name <user@host>`."""
NAMED_PATH = re.compile(
    r"^(?:--- |\+\+\+ |rename from |rename to |copy from |copy to )(.*?)\t?$"
)


@dataclass
class FileDiff:
    """One file's section of a patch."""

    path: str
    old_blob: str = ""
    new_blob: str = ""
    is_new: bool = False
    is_deleted: bool = False
    hunk_starts: list[int] = field(default_factory=list)

    def hunk_at(self, line: int) -> int:
        """1-based index of the hunk whose pre-image starts at `line`."""
        for index, start in enumerate(self.hunk_starts, 1):
            if start == line:
                return index
        return 0


@dataclass
class Patch:
    """A parsed `git format-patch` mbox file."""

    name: str
    path: Path
    author: str
    subject: str
    body: str
    files: list[FileDiff]

    @property
    def hunks(self) -> int:
        return sum(len(f.hunk_starts) for f in self.files)

    def file(self, path: str) -> FileDiff | None:
        return next((f for f in self.files if f.path == path), None)


@dataclass
class Series:
    """One base's series, parsed once per command and passed down."""

    base: Base
    patches: list[Patch]

    @classmethod
    def load(cls, base: Base) -> "Series":
        """`base`'s series; a missing or corrupt patch raises."""
        return cls(base, load_series(base.patches))

    @cached_property
    def touched(self) -> dict[str, bool]:
        """Every path the series touches, in the order first touched,
        mapped to whether it existed before the series."""
        first_touch: dict[str, bool] = {}
        for patch in self.patches:
            for diff in patch.files:
                first_touch.setdefault(diff.path, not diff.is_new)
        return first_touch

    @cached_property
    def created(self) -> frozenset[str]:
        """The paths a patch of the series creates."""
        return frozenset(d.path for p in self.patches for d in p.files if d.is_new)

    @cached_property
    def source_files(self) -> list[str]:
        """The base files the series changes that vLLM's wheel does not ship
        (upstream's tests, docs): they come from the release's sdist."""
        return [
            p
            for p, existed in self.touched.items()
            if existed and not p.startswith("vllm/")
        ]

    @cached_property
    def test_files(self) -> list[str]:
        """The test files the series adds, as paths in vLLM's tree."""
        return sorted(
            p for p in self.created if p.startswith("tests/") and "/test_" in p
        )

    @property
    def hunks(self) -> int:
        return sum(p.hunks for p in self.patches)

    def creator(self, path: str) -> str:
        """The name of the first patch that touches `path`."""
        return next(p.name for p in self.patches if p.file(path))

    def blob_chain(self) -> tuple[list[str], dict[str, str]]:
        """(problems, each path's last blob id): blob ids must chain from
        patch to patch, as full ids (`format-patch --full-index`)."""
        problems: list[str] = []
        last: dict[str, str] = {}
        for patch in self.patches:
            for diff in patch.files:
                if len(diff.new_blob) != 40 or len(diff.old_blob) != 40:
                    problems.append(
                        f"{patch.name}: {diff.path}: index line lacks "
                        "full blob ids (use format-patch --full-index)"
                    )
                    continue
                previous = last.get(diff.path)
                if previous is not None and previous != diff.old_blob:
                    problems.append(
                        f"{patch.name}: {diff.path}: does not start "
                        "where the previous patch left it"
                    )
                last[diff.path] = diff.new_blob
        return problems, last

    @cached_property
    def id(self) -> str:
        """The hex sha256 over the patch files, in order, names included."""
        digest = hashlib.sha256()
        for patch in self.patches:
            digest.update(patch.name.encode() + b"\0" + patch.path.read_bytes() + b"\0")
        return digest.hexdigest()

    @property
    def short_id(self) -> str:
        return self.id[:SHORT_ID_LENGTH]

    @property
    def version(self) -> str:
        """The PEP 440 version `<base>+glm5next.<short id>` of the patched
        wheel, normalized."""
        # An all-digit local segment compares as a number: normalizing drops
        # its leading zeros, and the dist-info name must be the normal form.
        label = str(int(self.short_id)) if self.short_id.isdigit() else self.short_id
        return f"{self.base.version}+{LOCAL_LABEL}.{label}"

    def manifest(self) -> bytes:
        """The contents of `vllm/glm5next_series.json` (SERIES_FILE)."""
        manifest = {
            "series": LOCAL_LABEL,
            "id": self.id,
            "short_id": self.short_id,
            "version": self.version,
            "base": {"version": self.base.version, "commit": self.base.commit},
            "patches": [
                {"name": p.name, "subject": p.subject, "sha256": file_sha256(p.path)}
                for p in self.patches
            ],
        }
        return (json.dumps(manifest, indent=1) + "\n").encode()


def read_series(patches_dir: Path) -> list[str]:
    """Patch file names in `series`, in order; blank lines and # comments
    are ignored."""
    series = patches_dir / "series"
    if not series.is_file():
        raise PatchsetError(f"{series}: no series file")
    names = []
    for number, raw in enumerate(series.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not PATCH_NAME.match(line):
            raise PatchsetError(
                f"{series}:{number}: '{line}' is not a NNNN-name.patch entry"
            )
        if line in names:
            raise PatchsetError(f"{series}:{number}: '{line}' is listed twice")
        names.append(line)
    return names


def load_series(patches_dir: Path) -> list[Patch]:
    """Every patch of the series, parsed; a missing or corrupt one raises."""
    patches = []
    for name in read_series(patches_dir):
        path = patches_dir / name
        if not path.is_file():
            raise PatchsetError(
                f"{patches_dir / 'series'}: lists {name}, but {path} does not exist"
            )
        patches.append(parse_patch(path))
    return patches


def _header_value(lines: list[str], start: int) -> tuple[str, int]:
    """An RFC 2822 header value with its folded continuation lines."""
    value = lines[start].split(":", 1)[1].strip()
    index = start + 1
    while index < len(lines) and lines[index][:1] in (" ", "\t"):
        value += " " + lines[index].strip()
        index += 1
    return value, index


def parse_patch(path: Path) -> Patch:
    """Parse one mbox patch; raise a PatchsetError naming the file and line
    for anything that `git am` would reject or that is not a patch."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PatchsetError(f"{path}: not UTF-8 text ({exc.reason})") from exc
    lines = text.split("\n")
    if not lines or not MBOX_FROM.match(lines[0]):
        raise PatchsetError(
            f"{path}:1: not a `git format-patch` mbox (no 'From <sha> ...' line)"
        )
    headers: dict[str, str] = {}
    index = 1
    while index < len(lines) and lines[index]:
        if ":" not in lines[index]:
            raise PatchsetError(f"{path}:{index + 1}: malformed header line")
        key = lines[index].split(":", 1)[0]
        headers[key.lower()], index = _header_value(lines, index)
    for required in ("from", "subject"):
        if required not in headers:
            raise PatchsetError(f"{path}: no {required.title()}: header")
    if not AUTHOR.match(headers["from"]):
        raise PatchsetError(
            f"{path}: From: '{headers['from']}' is not 'Name <user@host>'; "
            "`git am` takes no patch without its author"
        )
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", headers["subject"])
    if not subject.strip():
        raise PatchsetError(f"{path}: empty Subject: header")
    body_start = index + 1
    try:
        separator = lines.index("---", body_start)
    except ValueError:
        raise PatchsetError(f"{path}: no '---' line ends the message") from None
    body = "\n".join(lines[body_start:separator]).strip("\n")
    files = _parse_diff(path, lines, separator + 1)
    if not files:
        raise PatchsetError(f"{path}: contains no 'diff --git' section")
    return Patch(path.name, path, headers["from"], subject, body, files)


def _parse_diff(path: Path, lines: list[str], start: int) -> list[FileDiff]:
    """The file sections of a diff, validating every hunk's line counts."""
    files: list[FileDiff] = []
    index = start
    while index < len(lines):
        line = lines[index]
        if line == "-- ":
            break
        if line.startswith("diff --git "):
            match = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
            if not match:
                raise PatchsetError(f"{path}:{index + 1}: malformed diff header")
            for named in match.groups():
                _require_inside(path, index, named)
            files.append(FileDiff(match.group(2)))
        elif files and (m := NAMED_PATH.match(line)):
            named = m.group(1)
            if line.startswith(("--- ", "+++ ")):
                if named == "/dev/null":
                    index += 1
                    continue
                named = re.sub(r"^[ab]/", "", named)
            _require_inside(path, index, named)
        elif files and (m := INDEX.match(line)):
            files[-1].old_blob, files[-1].new_blob = m.groups()
        elif files and line.startswith("new file mode"):
            files[-1].is_new = True
        elif files and line.startswith("deleted file mode"):
            files[-1].is_deleted = True
        elif line.startswith("@@"):
            if not files:
                raise PatchsetError(f"{path}:{index + 1}: hunk outside a file")
            index = _check_hunk(path, lines, index, files[-1])
            continue
        index += 1
    return files


def _require_inside(patch: Path, index: int, named: str) -> None:
    """Raise unless `named` (a path in a patch) stays inside the tree."""
    parts = named.split("/")
    if named.startswith("/") or ".." in parts or "" in parts or "\\" in named:
        raise PatchsetError(
            f"{patch}:{index + 1}: path '{named}' is absolute or leaves the "
            "tree; a patch may only name files inside vLLM's tree"
        )


def _check_hunk(path: Path, lines: list[str], index: int, diff: FileDiff) -> int:
    """Validate the hunk at `index` against its header; return the next line."""
    match = HUNK.match(lines[index])
    if not match:
        raise PatchsetError(f"{path}:{index + 1}: malformed hunk header")
    old_start, old_len, _, new_len = match.groups()
    want_old = int(old_len) if old_len is not None else 1
    want_new = int(new_len) if new_len is not None else 1
    diff.hunk_starts.append(int(old_start))
    header_line = index + 1
    index += 1
    old = new = 0
    while index < len(lines) and (old < want_old or new < want_new):
        tag = lines[index][:1]
        if tag == " ":
            old, new = old + 1, new + 1
        elif tag == "-":
            old += 1
        elif tag == "+":
            new += 1
        elif tag != "\\":
            break
        index += 1
    if (old, new) != (want_old, want_new):
        raise PatchsetError(
            f"{path}:{header_line}: corrupt hunk {len(diff.hunk_starts)} of "
            f"{diff.path}: header says -{want_old}/+{want_new} lines, "
            f"body has -{old}/+{new}"
        )
    while index < len(lines) and lines[index].startswith("\\"):
        index += 1
    return index
