# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What a maintainer's hands find: patch paths leaving the tree, bad
arguments to every subcommand, the working directory and the help texts."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from projectkit import PROBE, Project, in_mount_namespace, needs_unshare

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
            (
                "diff --git a/x.py b/x.py\nnew file mode 100644\n"
                "--- /dev/null\n+++ b/vllm/../../evil.py\n"
            ),
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


BAD_INVOCATIONS = {
    "setup": ["setup", "--base", "9.9.9"],
    "env": ["env", "--base", "nope"],
    "apply-src": ["apply", "--vllm-src", "/nonexistent"],
    "apply-dest": ["apply", "--dest", "/proc/version/tree"],
    "run-empty": ["run"],
    "run-missing": ["run", "--pristine", "--", "/nonexistent/command"],
    "worktree": ["worktree", "--dest", "/proc/nonexistent/work"],
    "refresh": ["refresh", "1", "--vllm-src", "/nonexistent"],
    "rebase": ["rebase", "--onto", "9.9.9"],
    "bisect-run": ["bisect-run", "--vllm-src", "/nonexistent"],
    "export": ["export", "--vllm-src", "/nonexistent", "--branch", "x"],
    "test": ["test", "--base", "9.9.9"],
    "upstream-checks": ["upstream-checks", "--base", "9.9.9"],
    "gpu": ["gpu", "--collect", "/nonexistent"],
    "build": ["build", "--base", "9.9.9"],
    "verify-install": ["verify-install", "/nonexistent/python"],
    "capacity": ["capacity", "--pristine", "--batch", "/nonexistent.json"],
    "coverage": ["coverage", "--pristine", "--batch", "NOT_JSON"],
    "coverage-base": ["coverage", "--base", "9.9.9"],
}


@pytest.mark.parametrize("argv", BAD_INVOCATIONS.values(), ids=BAD_INVOCATIONS)
def test_bad_arguments_give_one_line_not_a_traceback(
    project: Project, series: Path, tmp_path: Path, argv: list[str]
) -> None:
    if "NOT_JSON" in argv:
        bad = tmp_path / "cases.json"
        bad.write_text("[['--json'")
        argv = [str(bad) if a == "NOT_JSON" else a for a in argv]
    result = project.patchset(*argv)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    error = [line for line in result.stderr.splitlines() if "error" in line]
    assert error, result.stderr
    assert len(error[0]) > len("patchset: error: ") + 10


def test_run_keeps_the_callers_working_directory(
    project: Project, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "myscript.py").write_text("import os; print(os.getcwd())\n")
    result = subprocess.run(
        [sys.executable, str(project.root / "scripts" / "patchset"), "run"]
        + ["--pristine", "--", "python", "myscript.py"],
        cwd=elsewhere,
        env=project.env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(elsewhere)


@pytest.mark.parametrize("report", ["coverage", "capacity"])
def test_report_help_shows_every_option(project: Project, report: str) -> None:
    result = project.patchset(report, "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--base VERSION", "--pristine", "--batch FILE", "--json"):
        assert option in result.stdout
    options = [
        line.split()[0]
        for line in result.stdout.split("options:", 1)[1].splitlines()
        if line.startswith("  -")
    ]
    described = [line for line in result.stdout.splitlines() if line.startswith("  -")]
    assert len(options) >= 5
    assert all(len(line.split(None, 2)) >= 2 for line in described)


def test_top_level_help_says_where_to_start(project: Project) -> None:
    result = project.patchset("--help")
    assert result.returncode == 0
    assert "where to start:" in result.stdout
    assert "scripts/patchset setup" in result.stdout


@needs_unshare
def test_setup_with_a_complete_read_only_cache(project: Project) -> None:
    """The shared environments, read-only (a bind mount in a private mount
    namespace: root ignores permission bits): setup reuses them."""
    envs = (project.cache / "envs").resolve()
    script = (
        f"mount --bind {envs} {envs} && mount -o remount,bind,ro {envs} && "
        "exec python3 scripts/patchset setup"
    )
    result = in_mount_namespace(script, project.root, project.env)
    assert result.returncode == 0, result.stderr
    assert "environment ready" in result.stdout


def test_verify_install_checks_a_pip_target_folder(
    project: Project, pristine_site: Path, tmp_path: Path
) -> None:
    """`pip install --target DIR` has no interpreter of its own: the folder
    is checked; a one-byte drift is named."""
    target = tmp_path / "target"
    shutil.copytree(pristine_site, target, symlinks=True)
    cache = target / "vllm" / "__pycache__" / "version.cpython-312.pyc"
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(b"not checked, and said so")
    good = project.patchset("verify-install", str(target))
    assert good.returncode == 0, good.stderr
    assert f"site-packages: {target}" in good.stdout
    assert "match RECORD" in good.stdout
    assert "bytecode: 1 file(s) under __pycache__ not checked" in good.stdout
    version = target / "vllm" / "version.py"
    version.write_bytes(version.read_bytes() + b"#")
    drifted = project.patchset("verify-install", str(target))
    assert drifted.returncode == 1
    assert "vllm/version.py: sha256 differs from RECORD" in drifted.stderr
