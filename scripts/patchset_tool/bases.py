# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The supported vLLM releases, declared in `bases.toml`, and where each
one's series, overlay, requirements and build outputs live."""

import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import paths
from .errors import PatchsetError

DECLARATION = paths.REPO / "bases.toml"


@dataclass(frozen=True)
class Base:
    """One supported vLLM release and the project files that belong to it."""

    version: str
    commit: str
    primary: bool

    @property
    def version_key(self) -> tuple[int, ...]:
        """The version as numbers, for ordering releases."""
        return tuple(int(part) for part in self.version.split("."))

    @property
    def tag(self) -> str:
        return f"v{self.version}"

    @property
    def patches(self) -> Path:
        """The folder holding this base's `series` and its patches."""
        return paths.REPO / "patches" / self.version

    @property
    def series_file(self) -> Path:
        return self.patches / "series"

    @property
    def overlay(self) -> Path:
        """The post-patch copy of every file this base's series changes."""
        return paths.REPO / "vllm_overlay" / self.version

    @property
    def requirements(self) -> Path:
        """The folder with this base's `vllm.txt` (and `overrides.txt`)."""
        return paths.REQUIREMENTS / self.version

    @property
    def expected_base_failures(self) -> Path:
        return self.patches / "expected-base-failures.txt"

    @property
    def expected_cpu_failures(self) -> Path:
        return self.patches / "expected-cpu-failures.txt"

    @property
    def expected_skips(self) -> Path:
        return self.patches / "expected-skips.txt"

    @property
    def expected_sm90_failures(self) -> Path:
        return self.patches / "expected-sm90-failures.txt"

    @property
    def expected_sm90_skips(self) -> Path:
        return self.patches / "expected-sm90-skips.txt"

    def copy_of(self, path: str) -> Path:
        """This project's copy of `path` (a path in vLLM's source tree)."""
        return self.overlay / path

    def build_dir(self) -> Path:
        return paths.build_dir() / self.version

    def patched_tree(self) -> Path:
        """The directory put first on sys.path to import the patched vLLM."""
        return self.build_dir() / "vllm-patched"


def _declaration() -> dict[str, list[dict[str, object]]]:
    try:
        return tomllib.loads(DECLARATION.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise PatchsetError(f"{DECLARATION}: cannot read it: {exc}") from exc


def load_bases() -> list[Base]:
    """Every declared base, primary first; raise on a malformed file."""
    try:
        tables = _declaration().get("base", [])
        bases = [
            Base(str(t["version"]), str(t["commit"]), bool(t.get("primary")))
            for t in tables
        ]
    except (KeyError, TypeError) as exc:
        raise PatchsetError(f"{DECLARATION}: cannot read the bases: {exc}") from exc
    primaries = [b for b in bases if b.primary]
    if len(primaries) != 1:
        raise PatchsetError(
            f"{DECLARATION}: exactly one base must say `primary = true` "
            f"(found {len(primaries)})"
        )
    if len({b.version for b in bases}) != len(bases):
        raise PatchsetError(f"{DECLARATION}: a version is declared twice")
    return sorted(bases, key=lambda b: not b.primary)


def get_base(version: str | None = None) -> Base:
    """The base declared for `version`, or the primary base for None."""
    bases = load_bases()
    if version is None:
        return bases[0]
    for base in bases:
        if base.version == version:
            return base
    raise PatchsetError(
        f"no base {version} in {DECLARATION.name}; declared: "
        + ", ".join(b.version for b in bases)
    )


def release_order() -> list[Base]:
    """The declared bases from the oldest release to the newest."""
    return sorted(load_bases(), key=lambda b: b.version_key)


def previous_release(onto: Base) -> Base:
    """The newest declared base older than `onto` that has a series."""
    older = [
        b
        for b in release_order()
        if b.series_file.exists() and b.version_key < onto.version_key
    ]
    if not older:
        raise PatchsetError(f"no older base with a series to port onto {onto.tag}")
    return older[-1]


def declared_differences() -> dict[str, str]:
    """Patch subjects that not every base's series carries, mapped to the
    reason `bases.toml` gives (its `[[difference]]` tables)."""
    try:
        return {
            str(t["subject"]): str(t["reason"])
            for t in _declaration().get("difference", [])
        }
    except (KeyError, TypeError) as exc:
        raise PatchsetError(f"{DECLARATION}: malformed [[difference]]: {exc}") from exc


def declared_same() -> dict[str, str]:
    """Paths (in vLLM's tree) whose overlay copy must be the same file in
    every base, mapped to the reason `bases.toml` gives (its `[[same]]`
    tables: `paths` and `reason`)."""
    same: dict[str, str] = {}
    try:
        for table in _declaration().get("same", []):
            listed, reason = table["paths"], str(table["reason"])
            if not isinstance(listed, list):
                raise TypeError("`paths` must be a list of paths")
            same |= {str(path): reason for path in listed}
    except (KeyError, TypeError) as exc:
        raise PatchsetError(f"{DECLARATION}: malformed [[same]]: {exc}") from exc
    return same
