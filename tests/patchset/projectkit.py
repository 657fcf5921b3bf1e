# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers for the tool's tests: a copy of this project and real patches
made with git against real pristine vLLM files."""

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SPDX = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
)
IDENTITY = {
    "GIT_AUTHOR_NAME": "Test Author",
    "GIT_AUTHOR_EMAIL": "a@example.com",
    "GIT_COMMITTER_NAME": "Test Author",
    "GIT_COMMITTER_EMAIL": "a@example.com",
}
KDA = "vllm/models/glm5next/common/kda.py"
INIT = "vllm/models/glm5next/__init__.py"
PROBE = "vllm/models/glm5next/probe.py"
PROBE_TEST = "tests/models/glm5next/test_probe.py"


def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, **IDENTITY}
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


@dataclass
class Project:
    """A copy of this project whose series the test writes."""

    root: Path
    env: dict[str, str]

    def patchset(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(self.root / "scripts" / "patchset"), *args],
            cwd=self.root,
            env=env or self.env,
            capture_output=True,
            text=True,
        )

    @property
    def patched(self) -> Path:
        return self.root / "build" / "vllm-patched"


Edit = Callable[[str], str]


def write_series(
    project: Project,
    site: Path,
    patches: list[tuple[str, dict[str, Edit]]],
    workdir: Path,
) -> Path:
    """Make real patches with git: a repository holding the pristine files
    the edits touch, one commit per (subject, {path: edit}); write them into
    the project's series, overlay and tests. Returns the repository."""
    repo = workdir / "src"
    repo.mkdir()
    git("init", "--quiet", cwd=repo)
    paths = {p for _, edits in patches for p in edits}
    for rel in sorted(paths):
        if (site / rel).is_file():
            (repo / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(site / rel, repo / rel)
    (repo / "README").write_text("base\n")
    git("add", "--all", cwd=repo)
    git("commit", "--quiet", "-m", "base", cwd=repo)
    git("tag", "base", cwd=repo)
    for subject, edits in patches:
        for rel, edit in edits.items():
            target = repo / rel
            old = target.read_text() if target.exists() else ""
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(edit(old))
        git("add", "--all", cwd=repo)
        body = (
            f"{subject}\n\nThis change exists so that the tool's tests have "
            "a real patch with a body that says why it is needed.\n\n"
            "Signed-off-by: Test Author <a@example.com>\n"
        )
        git("commit", "--quiet", "-m", body, cwd=repo)
    names = git(
        "format-patch",
        "--full-index",
        "-o",
        str(project.root / "patches"),
        "base..HEAD",
        cwd=repo,
    ).split()
    (project.root / "patches" / "series").write_text(
        "".join(Path(n).name + "\n" for n in names)
    )
    for rel in paths:
        where = project.root / ("vllm_overlay" if rel.startswith("vllm/") else "")
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / rel, where / rel)
    return repo


def two_patches() -> list[tuple[str, dict[str, Edit]]]:
    """Patch 1 adds a module and its test and edits __init__.py; patch 2
    edits kda.py and __init__.py again (so the two chain)."""
    return [
        (
            "[Model] Add a probe module to glm5next",
            {
                PROBE: lambda _: SPDX + "ANSWER = 42\n",
                PROBE_TEST: lambda _: SPDX
                + (
                    "from vllm.models.glm5next.probe import ANSWER\n\n\n"
                    "def test_probe():\n    assert ANSWER == 42\n"
                ),
                INIT: lambda old: old + "# probe: patch 1\n",
            },
        ),
        (
            "[Model] Touch KDA and the package init",
            {
                KDA: lambda old: old.replace("import ", "import  ", 1),
                INIT: lambda old: old + "# probe: patch 2\n",
            },
        ),
    ]
