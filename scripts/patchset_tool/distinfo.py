# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The vllm distribution in a site-packages folder: its version and RECORD,
the proof that its files are as RECORD says, and the install a base's
series applies to."""

import csv
import os
from dataclasses import dataclass
from pathlib import Path

from . import envmgr
from .bases import Base
from .digests import record_digest
from .errors import PatchsetError
from .series import Series

SITE_VAR = "GLM5NEXT_PATCHSET_SITE"


def read_record(dist_info: Path) -> dict[str, str]:
    """RECORD as path to hash ("" where RECORD gives none)."""
    with open(dist_info / "RECORD", newline="", encoding="utf-8") as handle:
        try:
            return {
                row[0]: row[1] if len(row) > 1 else ""
                for row in csv.reader(handle)
                if row
            }
        except csv.Error as exc:
            raise PatchsetError(
                f"{dist_info / 'RECORD'}: not a RECORD file ({exc}); the install "
                "is damaged"
            ) from exc


@dataclass(frozen=True)
class InstalledVllm:
    """The vllm distribution in one site-packages directory."""

    site: Path
    dist_info: Path
    version: str
    record: dict[str, str]
    """Every RECORD path (relative to `site`) to its hash; "" for none."""

    @property
    def package(self) -> Path:
        return self.site / "vllm"

    def verify(self, relpaths: list[str]) -> None:
        """Raise naming every file (relative to site-packages) whose bytes
        differ from RECORD, or that RECORD does not list with a hash."""
        problems = []
        for rel in relpaths:
            want = self.record.get(rel)
            path = self.site / rel
            if not want:
                problems.append(f"{rel}: not listed in {self.dist_info.name}/RECORD")
            elif not path.is_file():
                problems.append(f"{rel}: missing from {self.site}")
            elif record_digest(path) != want:
                problems.append(
                    f"{rel}: differs from the sha256 in RECORD (drifted base "
                    f"file; reinstall vllm=={self.version})"
                )
        if problems:
            raise PatchsetError(
                "the installed vLLM is not pristine:\n  " + "\n  ".join(problems)
            )


def find_vllm(site: Path) -> InstalledVllm:
    """The one vllm distribution installed in `site`; raise if none or more."""
    found = sorted(site.glob("vllm-*.dist-info"))
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise PatchsetError(
            f"{site}: expected one vllm-*.dist-info, found {names}"
            + ("" if found else "; vLLM is not installed there")
        )
    dist_info = found[0]
    version = ""
    for line in (dist_info / "METADATA").read_text(encoding="utf-8").splitlines():
        if line.startswith("Version:"):
            version = line.split(":", 1)[1].strip()
            break
    return InstalledVllm(site, dist_info, version, read_record(dist_info))


def find_base_install(site: Path, base: Base) -> InstalledVllm:
    """The vllm install in `site`; raise if absent or not `base`'s version."""
    install = find_vllm(site)
    if install.version != base.version:
        raise PatchsetError(
            f"{site}: vllm {install.version or '(unknown)'} is installed, but "
            f"this series is for vllm=={base.version} (commit {base.commit}); "
            f"run `scripts/patchset setup --base {base.version}`"
        )
    return install


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


def check_base(install: InstalledVllm, series: Series) -> list[str]:
    """Verify the base files `series` modifies against `install`'s RECORD
    and that none it creates exists; return the vllm/ paths that must
    pre-exist, or raise listing every problem."""
    existing, problems = [], []
    for path, existed in series.touched.items():
        in_wheel = path.startswith("vllm/")
        if existed and in_wheel:
            existing.append(path)
        elif existed:
            continue  # not in the wheel: taken from the release's sdist
        elif in_wheel and (install.site / path).exists():
            problems.append(
                f"{series.creator(path)}: creates {path}, which already exists "
                f"in {install.site}"
            )
    if problems:
        raise PatchsetError("the series cannot apply here:\n  " + "\n  ".join(problems))
    install.verify(existing)
    return existing
