# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What `check` passes, `apply` applies: the same parser, the same
application to the RECORD-verified base files."""

import shutil
from pathlib import Path

import pytest
from projectkit import SPDX, Project, commit_message, git


def patch_1(project: Project) -> Path:
    return sorted(project.patches().glob("0001-*.patch"))[0]


def add_patch_to_a_file_outside_the_wheel(project: Project, tmp_path: Path) -> None:
    """Patch 3 edits setup.py, which the release has and its wheel lacks
    (what `refresh` used to fold in)."""
    repo = tmp_path / "outside"
    repo.mkdir()
    git("init", "--quiet", cwd=repo)
    (repo / "setup.py").write_text(SPDX + "setup()\n")
    git("add", "--all", cwd=repo)
    git("commit", "--quiet", "-m", "base", cwd=repo)
    (repo / "setup.py").write_text(SPDX + "setup(name='x')\n")
    git(
        "commit", "--quiet", "-am", commit_message("[Build] Name the package"), cwd=repo
    )
    made = git(
        "format-patch",
        "--full-index",
        "--start-number",
        "3",
        "-1",
        "-o",
        str(project.patches()),
        "HEAD",
        cwd=repo,
    ).strip()
    with open(project.series_file(), "a") as listing:
        listing.write(Path(made).name + "\n")
    shutil.copyfile(repo / "setup.py", project.overlay() / "setup.py")


def hand_edit_a_plus_line(project: Project, tmp_path: Path) -> None:
    patch = patch_1(project)
    patch.write_text(patch.read_text().replace("+ANSWER = 42", "+ANSWER = 41"))


def empty_from(project: Project, tmp_path: Path) -> None:
    patch = patch_1(project)
    lines = patch.read_text().split("\n")
    start = next(n for n, line in enumerate(lines) if line.startswith("From: "))
    end = start + 1
    while lines[end].startswith(" "):
        end += 1
    lines[start:end] = ["From: "]
    patch.write_text("\n".join(lines))


@pytest.mark.parametrize(
    "damage", [hand_edit_a_plus_line, add_patch_to_a_file_outside_the_wheel, empty_from]
)
def test_check_refuses_what_apply_refuses(
    project: Project, series: Path, tmp_path: Path, damage
) -> None:
    assert project.patchset("check").returncode == 0
    damage(project, tmp_path)
    applied = project.patchset("apply", "--check")
    checked = project.patchset("check")
    assert applied.returncode == 1, applied.stdout + applied.stderr
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "Traceback" not in checked.stderr
