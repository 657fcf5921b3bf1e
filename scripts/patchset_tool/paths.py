# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Where things live: the project, its build outputs and the shared cache."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL_TESTS = Path("tests/models/glm5next")
"""Where the series' model tests live in vLLM's source tree."""
SUITE = REPO / "tests" / "models" / "glm5next"
"""This project's own verification suite, one copy for every base."""
SUITE_EXPECTED_SKIPS = SUITE / "expected-skips.txt"
"""The suite's tests that may skip on a CPU-only host (they need a GPU)."""
REQUIREMENTS = REPO / "ci" / "requirements"

CACHE_ENV_VAR = "GLM5NEXT_PATCHSET_CACHE"
BUILD_ENV_VAR = "GLM5NEXT_PATCHSET_BUILD"


def build_dir() -> Path:
    """The build directory: `build/` in the clone unless overridden."""
    override = os.environ.get(BUILD_ENV_VAR)
    return Path(override).resolve() if override else REPO / "build"


def cache_root() -> Path:
    """The cache shared by every clone on this machine."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "glm5next-patchset"


CACHE_DIRS = {"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def files_under(root: Path) -> list[Path]:
    """Files below `root`, leaving out tool caches."""
    if not root.is_dir():
        return []
    return sorted(
        p for p in root.rglob("*") if p.is_file() and not CACHE_DIRS & set(p.parts)
    )
