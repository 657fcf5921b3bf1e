# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Helpers for the tool's tests: a copy of this project and real patches
made with git against real pristine vLLM files."""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

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
# Outside the glm5next package, so that its test imports vLLM's light top level
# only, not the whole model (tens of seconds of bytecode compile in a fresh tree).
PROBE = "vllm/glm5next_probe.py"
PROBE_TEST = "tests/models/glm5next/test_probe.py"


needs_unshare = pytest.mark.skipif(
    shutil.which("unshare") is None, reason="needs unshare(1)"
)


def in_mount_namespace(
    script: str, cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """Run the sh `script` in a private mount namespace, as a user mapped to
    root: its mounts (a small tmpfs, a read-only bind) touch nothing outside,
    and root there still meets a read-only mount, unlike permission bits."""
    return subprocess.run(
        ["unshare", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )


def git(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    env = {**(env or os.environ), **IDENTITY}
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


@dataclass
class Project:
    """A copy of this project whose bases.toml and series the test writes.

    `version` is the base the project declares as its primary one."""

    root: Path
    env: dict[str, str]
    version: str

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

    def patches(self, version: str | None = None) -> Path:
        """patches/<version>/: a base's series file and its patches."""
        return self.root / "patches" / (version or self.version)

    def series_file(self, version: str | None = None) -> Path:
        return self.patches(version) / "series"

    def overlay(self, version: str | None = None) -> Path:
        """vllm_overlay/<version>/: the post-patch copy of every file the
        base's series changes (vllm/ and tests/ files alike)."""
        return self.root / "vllm_overlay" / (version or self.version)

    def build(self, version: str | None = None) -> Path:
        """build/<version>/: a base's build outputs."""
        return self.root / "build" / (version or self.version)

    @property
    def patched(self) -> Path:
        return self.build() / "vllm-patched"

    @property
    def cache(self) -> Path:
        return Path(self.env["GLM5NEXT_PATCHSET_CACHE"])


def declare_bases(
    project: Project,
    versions: list[str],
    differences: dict[str, str] | None = None,
    commit: str = "0123456789",
    same: list[str] | None = None,
) -> None:
    """Rewrite the project's bases.toml: `versions` (the first one
    primary), the declared differences {subject: reason} and the paths
    declared the same in every base (one `[[same]]` table). A version
    without requirements gets a pin of its own, so that it has no managed
    environment (its base files are not verified against RECORD)."""
    text = ""
    for number, version in enumerate(versions):
        text += f'[[base]]\nversion = "{version}"\ncommit = "{commit}"\n'
        text += "primary = true\n\n" if number == 0 else "\n"
        pins = project.root / "ci" / "requirements" / version / "vllm.txt"
        if not pins.is_file():
            pins.parent.mkdir(parents=True)
            pins.write_text(f"vllm=={version}\n")
    for subject, reason in (differences or {}).items():
        text += f'[[difference]]\nsubject = "{subject}"\nreason = "{reason}"\n\n'
    if same:
        text += f'[[same]]\npaths = {json.dumps(same)}\nreason = "shared"\n'
    (project.root / "bases.toml").write_text(text)
    project.version = versions[0]


def build_history(repo: Path, releases: list[tuple[str, Path]]) -> Path:
    """A release history as `upstream.release_history()` keeps it in the
    cache: one commit per (version, tree), oldest first, tagged
    `v<version>`. Compiled extensions are left out, as in an sdist."""
    repo.mkdir(parents=True)
    git("init", "--quiet", "-b", "releases", cwd=repo)
    for version, tree in releases:
        git("rm", "-r", "--quiet", "--ignore-unmatch", ".", cwd=repo)
        shutil.copytree(
            tree,
            repo,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.dist-info"),
        )
        git("add", "--all", "--force", cwd=repo)
        git("commit", "--quiet", "-m", f"vLLM {version} sdist", cwd=repo)
        git("tag", f"v{version}", cwd=repo)
    return repo


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Write `files` ({path: text}) under `root`; return `root`."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


Edit = Callable[[str], str]


def commit_message(subject: str) -> str:
    return (
        f"{subject}\n\nThis change exists so that the tool's tests have "
        "a real patch with a body that says why it is needed.\n\n"
        "Signed-off-by: Test Author <a@example.com>\n"
    )


def write_series(
    project: Project,
    site: Path,
    patches: list[tuple[str, dict[str, Edit]]],
    workdir: Path,
    version: str | None = None,
) -> Path:
    """Make real patches with git: a repository holding the pristine files
    the edits touch, one commit per (subject, {path: edit}); write them into
    the series and overlay of the base `version` (default: the project's
    primary one). Returns the repository."""
    repo = workdir / "src"
    repo.mkdir(parents=True)
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
        git("commit", "--quiet", "-m", commit_message(subject), cwd=repo)
    patches_dir = project.patches(version)
    shutil.rmtree(patches_dir, ignore_errors=True)
    names = git(
        "format-patch", "--full-index", "-o", str(patches_dir), "base..HEAD", cwd=repo
    ).split()
    (patches_dir / "series").write_text("".join(Path(n).name + "\n" for n in names))
    overlay = project.overlay(version)
    shutil.rmtree(overlay, ignore_errors=True)
    for rel in paths:
        (overlay / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / rel, overlay / rel)
    return repo


def two_patches() -> list[tuple[str, dict[str, Edit]]]:
    """Patch 1 adds a module and its test and edits __init__.py; patch 2
    edits kda.py and __init__.py again (so the two chain)."""
    return [
        (
            "[Model] Add a probe module to glm5next",
            {
                PROBE: lambda _: SPDX + "ANSWER = 42\n",
                PROBE_TEST: lambda _: (
                    SPDX
                    + (
                        "from vllm.glm5next_probe import ANSWER\n\n\n"
                        "def test_probe():\n    assert ANSWER == 42\n"
                    )
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


def declared_versions() -> list[str]:
    """This repository's declared bases: the tests of the real series run
    on each (one without a series fails them: see `require_series`)."""
    from patchset_tool import bases

    return [b.version for b in bases.load_bases()]


def require_series(version: str) -> None:
    """Fail, saying why, when base `version` of this repository has no
    series."""
    import pytest

    from patchset_tool import bases

    base = bases.get_base(version)
    if not base.series_file.exists():
        pytest.fail(
            f"bases.toml declares vLLM {version}, but {base.series_file} does "
            f"not exist: port the series (`scripts/patchset rebase --onto "
            f"{version}`) or remove the base from bases.toml"
        )


def report_batch(
    command: str, version: str, pristine: bool, cases: list[list[str]]
) -> list[dict]:
    """`scripts/patchset COMMAND --base VERSION [--pristine] --batch FILE` on
    this repository: one process (one vLLM import) prints one JSON report
    per argument list in `cases`, in order."""
    import json
    import tempfile

    require_series(version)
    tree = ["--base", version] + (["--pristine"] if pristine else [])
    with tempfile.TemporaryDirectory() as tmp:
        batch = Path(tmp) / "cases.json"
        batch.write_text(json.dumps(cases))
        result = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "patchset"), command, *tree]
            + ["--batch", str(batch)],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    reports = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    assert len(reports) == len(cases), result.stdout[-2000:]
    return reports
