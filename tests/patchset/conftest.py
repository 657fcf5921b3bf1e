# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the tool's tests: a throw-away copy of this project that
declares one base (the vLLM release installed in the primary base's managed
environment), a real copy of that pristine vllm package, and real patches
made with git."""

import csv
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The tool's package lives in scripts/; make `import patchset_tool` work.
sys.path.insert(0, str(REPO / "scripts"))

from projectkit import (  # noqa: E402
    Project,
    build_history,
    two_patches,
    write_series,
)

from patchset_tool import bases, envmgr, paths  # noqa: E402
from patchset_tool.distinfo import find_base_install  # noqa: E402


@pytest.fixture(scope="session")
def primary_base() -> bases.Base:
    """This repository's primary base, as bases.toml declares it."""
    return bases.get_base()


@pytest.fixture(scope="session")
def installed_version(primary_base: bases.Base) -> str:
    """The vLLM version installed in the primary base's environment."""
    python = envmgr.env_python(primary_base)
    assert python is not None
    return find_base_install(envmgr.site_packages(python), primary_base).version


@pytest.fixture(scope="session")
def pristine_site(
    tmp_path_factory: pytest.TempPathFactory, primary_base: bases.Base
) -> Path:
    """A real copy of the installed vllm package, so that tests may damage
    it, cut to what `import vllm` loads and the glm5next package (all the
    fixture series touches): about a hundred of its six thousand files."""
    python = envmgr.env_python(primary_base)
    assert python is not None
    loaded = subprocess.run(
        [str(python), "-c", "import sys, vllm; print(*sys.modules)"],
        capture_output=True,
        check=True,
        text=True,
        cwd=tmp_path_factory.getbasetemp(),
    ).stdout.split()
    packages = {m.split(".")[1] + "/" for m in loaded if m.startswith("vllm.")}

    real, site = envmgr.site_packages(python), tmp_path_factory.mktemp("site")
    for src in (real / "vllm").rglob("*"):
        rel = src.relative_to(real).as_posix()
        inside = rel.removeprefix("vllm/")
        kept = "/" not in inside or inside.startswith(("models/glm5next/", *packages))
        if src.is_dir() or "__pycache__" in rel or not kept:
            continue
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel.endswith(".so"):  # extensions symlinked, as in build/
            os.symlink(src, site / rel)
        else:
            shutil.copyfile(src, site / rel)
    for dist in real.glob("vllm-*.dist-info"):  # its RECORD lists just these
        shutil.copytree(dist, site / dist.name)
        with (dist / "RECORD").open(newline="") as record:
            rows = [r for r in csv.reader(record) if (site / r[0]).is_file()]
        with (site / dist.name / "RECORD").open("w", newline="") as record:
            csv.writer(record, lineterminator="\n").writerows(rows)
    return site


@pytest.fixture(scope="session")
def release_source(
    tmp_path_factory: pytest.TempPathFactory,
    pristine_site: Path,
    installed_version: str,
) -> Path:
    """A release history (as `upstream.release_history()` caches it) with
    the pristine package's source as the one release, tagged
    v<installed version>; no sdist is downloaded."""
    repo = tmp_path_factory.mktemp("history") / "vllm-history"
    return build_history(repo, [(installed_version, pristine_site)])


@pytest.fixture
def project(
    tmp_path: Path,
    pristine_site: Path,
    primary_base: bases.Base,
    installed_version: str,
) -> Project:
    root = tmp_path / "project"
    shutil.copytree(
        REPO / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(REPO / "ci" / "requirements", root / "ci" / "requirements")
    suite = root / paths.SUITE.relative_to(REPO)
    suite.mkdir(parents=True)
    # bisect-run loads the CPU host's plugin; vLLM's platforms, which it
    # completes, are not in the slim copy.
    (suite / "glm5next_cpu_host.py").write_text('"""The CPU-host plugin."""\n')
    (root / "bases.toml").write_text(
        "[[base]]\n"
        f'version = "{installed_version}"\n'
        f'commit = "{primary_base.commit}"\n'
        "primary = true\n"
    )
    patches = root / "patches" / installed_version
    patches.mkdir(parents=True)
    (patches / "series").write_text("")
    (root / "vllm_overlay" / installed_version).mkdir(parents=True)
    # A cache of the project's own, so that no test rewrites the shared
    # release history; the managed environments are the shared ones.
    cache = tmp_path / "cache"
    cache.mkdir()
    for shared in ("envs", "tools"):
        (cache / shared).symlink_to(paths.cache_root() / shared)
    env = {
        **os.environ,
        "GLM5NEXT_PATCHSET_SITE": str(pristine_site),
        "GLM5NEXT_PATCHSET_CACHE": str(cache),
    }
    env.pop("GLM5NEXT_PATCHSET_BUILD", None)
    return Project(root, env, installed_version)


@pytest.fixture
def history(project: Project, release_source: Path) -> Path:
    """The project's cache holds the release history of its one base."""
    repo = project.cache / "src" / f"vllm-history-{project.version}"
    repo.parent.mkdir()
    repo.symlink_to(release_source)
    return repo


@pytest.fixture
def series(project: Project, pristine_site: Path, tmp_path: Path) -> Iterator[Path]:
    """The project with the two-patch series; yields the git repository the
    patches were made in."""
    yield write_series(project, pristine_site, two_patches(), tmp_path)


@pytest.fixture
def work(project: Project, series: Path, history: Path, tmp_path: Path) -> Path:
    """`patchset worktree`: the release's source plus the series."""
    dest = tmp_path / "work"
    result = project.patchset("worktree", "--dest", str(dest))
    assert result.returncode == 0, result.stderr
    return dest
