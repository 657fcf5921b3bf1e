# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a maintainer's hands find: patch paths leaving the tree, bad
arguments to every subcommand, the working directory and the help texts."""

from pathlib import Path

import pytest
from projectkit import PROBE, Project

from patchset_tool.errors import PatchsetError
from patchset_tool.series import parse_patch

HEADER = (
    "From 0123456789012345678901234567890123456789 Mon Sep 17 00:00:00 2001\n"
    "From: A <a@example.com>\n"
    "Subject: [PATCH] [Misc] x\n\n"
    "Why.\n---\n"
)
HUNK = "@@ -0,0 +1 @@\n+x\n"


@pytest.mark.parametrize(
    "diff, line",
    [
        ("diff --git a/../evil.py b/../evil.py\nnew file mode 100644\n", 7),
        ("diff --git a//etc/evil b//etc/evil\nnew file mode 100644\n", 7),
        (
            "diff --git a/x.py b/x.py\nnew file mode 100644\n"
            "--- /dev/null\n+++ b/vllm/../../evil.py\n",
            10,
        ),
        ("diff --git a/x.py b/y.py\nrename from x.py\nrename to /tmp/y.py\n", 9),
    ],
    ids=["dotdot", "absolute", "plus-line", "rename-to"],
)
def test_patch_leaving_the_tree_is_refused(
    tmp_path: Path, diff: str, line: int
) -> None:
    patch = tmp_path / "0001-x.patch"
    patch.write_text(HEADER + diff + HUNK)
    with pytest.raises(PatchsetError) as caught:
        parse_patch(patch)
    assert f"{patch}:{line}: path " in str(caught.value)
    assert "leaves the tree" in str(caught.value)


@pytest.mark.parametrize("command", [["check"], ["apply", "--check"], ["apply"]])
def test_every_command_reading_a_patch_refuses_a_tree_leaving_path(
    project: Project, series: Path, command: list[str]
) -> None:
    patch = sorted(project.patches().glob("0001-*.patch"))[0]
    text = patch.read_text()
    assert f"diff --git a/{PROBE} b/{PROBE}\n" in text
    patch.write_text(text.replace(f"b/{PROBE}", "b/../escaped.py"))
    result = project.patchset(*command)
    assert result.returncode == 1, result.stdout + result.stderr
    assert patch.name in result.stderr and "leaves the tree" in result.stderr
    assert not (project.root / "build").exists() or command != ["check"]
    assert not (project.root / "escaped.py").exists()
    assert not (project.build() / "escaped.py").exists()
