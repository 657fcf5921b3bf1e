# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The pristine installed vLLM and the proof that its files are untouched."""

import base64
import csv
import hashlib
from dataclasses import dataclass
from pathlib import Path

from .bases import Base
from .errors import PatchsetError


def file_digest(path: Path) -> str:
    """The RECORD form of a file's sha256: urlsafe base64 without padding."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@dataclass
class Install:
    """An installed vllm distribution inside a site-packages directory."""

    site: Path
    dist_info: Path
    version: str
    record: dict[str, str]

    @property
    def package(self) -> Path:
        return self.site / "vllm"

    def verify(self, relpaths: list[str]) -> None:
        """Raise naming every file (relative to site-packages) whose bytes
        differ from RECORD, or that RECORD does not list."""
        problems = []
        for rel in relpaths:
            want = self.record.get(rel)
            path = self.site / rel
            if want is None:
                problems.append(f"{rel}: not listed in {self.dist_info.name}/RECORD")
            elif not path.is_file():
                problems.append(f"{rel}: missing from {self.site}")
            elif file_digest(path) != want:
                problems.append(
                    f"{rel}: differs from the sha256 in RECORD (drifted base "
                    f"file; reinstall vllm=={self.version})"
                )
        if problems:
            raise PatchsetError(
                "the installed vLLM is not pristine:\n  " + "\n  ".join(problems)
            )


def find_install(site: Path, base: Base) -> Install:
    """The vllm install in `site`; raise if absent or not `base`'s version."""
    dist_infos = sorted(site.glob("vllm-*.dist-info"))
    if not dist_infos:
        raise PatchsetError(f"no vllm installed in {site}")
    dist_info = dist_infos[0]
    version = ""
    for line in (dist_info / "METADATA").read_text().splitlines():
        if line.startswith("Version:"):
            version = line.split(":", 1)[1].strip()
            break
    if version != base.version:
        raise PatchsetError(
            f"{site}: vllm {version or '(unknown)'} is installed, but this "
            f"series is for vllm=={base.version} (commit {base.commit}); run "
            f"`scripts/patchset setup --base {base.version}`"
        )
    record: dict[str, str] = {}
    with open(dist_info / "RECORD", newline="") as handle:
        for row in csv.reader(handle):
            if len(row) >= 2 and row[1]:
                record[row[0]] = row[1]
    return Install(site, dist_info, version, record)
