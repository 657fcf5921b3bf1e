# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the tool's own tests: a throw-away copy of this project,
a real copy of the pristine vllm package, and real patches made with git."""

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The tool's package lives in scripts/; make `import patchset_tool` work.
sys.path.insert(0, str(REPO / "scripts"))

from projectkit import Project, two_patches, write_series  # noqa: E402

from patchset_tool import envmgr  # noqa: E402


@pytest.fixture(scope="session")
def pristine_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real copy of the installed vllm package and its dist-info, so that
    tests may damage it; extensions are symlinked as in build/."""
    python = envmgr.env_python()
    assert python is not None
    real = envmgr.site_packages(python)
    site = tmp_path_factory.mktemp("site")

    def copy(src: str, dst: str) -> None:
        os.symlink(src, dst) if src.endswith(".so") else shutil.copyfile(src, dst)

    shutil.copytree(
        real / "vllm",
        site / "vllm",
        copy_function=copy,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    for dist in real.glob("vllm-*.dist-info"):
        shutil.copytree(dist, site / dist.name)
    return site


@pytest.fixture
def project(tmp_path: Path, pristine_site: Path) -> Project:
    root = tmp_path / "project"
    shutil.copytree(
        REPO / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(REPO / "ci" / "requirements", root / "ci" / "requirements")
    (root / "patches").mkdir()
    (root / "patches" / "series").write_text("")
    (root / "vllm_overlay").mkdir()
    (root / "tests" / "models" / "glm5next").mkdir(parents=True)
    env = {**os.environ, "GLM5NEXT_PATCHSET_SITE": str(pristine_site)}
    env.pop("GLM5NEXT_PATCHSET_BUILD", None)
    return Project(root, env)


@pytest.fixture
def series(project: Project, pristine_site: Path, tmp_path: Path) -> Iterator[Path]:
    """The project with the two-patch series; yields the git repository the
    patches were made in."""
    yield write_series(project, pristine_site, two_patches(), tmp_path)
