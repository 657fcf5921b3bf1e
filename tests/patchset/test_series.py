# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Series`, the one way the tool reads a series, and the shape of the
tool around it: one module per command, one git wrapper, apply.py
imported only where patches are applied."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from module_floors import import_graph

from patchset_tool import bases, cli, paths
from patchset_tool.commands import COMMANDS, report
from patchset_tool.digests import file_sha256
from patchset_tool.series import SERIES_FILE, SHORT_ID_LENGTH, Series

TOOL = paths.REPO / "scripts" / "patchset_tool"
DIFF = re.compile(r"^diff --git a/(\S+) b/(\S+)$")


def paths_in_patch_text(series: Series) -> tuple[dict[str, bool], set[str]]:
    """(path -> existed before the series, paths created), read from the
    patch files' text alone, as the tool derived them before `Series`."""
    touched: dict[str, bool] = {}
    created: set[str] = set()
    for patch in series.patches:
        current, first = "", False
        for line in patch.path.read_text().splitlines():
            if match := DIFF.match(line):
                current = match.group(2)
                first = current not in touched
                touched.setdefault(current, True)
            elif line.startswith("new file mode") and current:
                created.add(current)
                if first:
                    touched[current] = False
    return touched, created


@pytest.mark.parametrize("base", bases.load_bases(), ids=lambda b: b.version)
def test_series_touched_and_created_match_the_patch_text(base: bases.Base) -> None:
    series = Series.load(base)
    touched, created = paths_in_patch_text(series)
    assert series.touched == touched
    assert list(series.touched) == list(touched)
    assert series.created == created
    overlay = {
        p.relative_to(base.overlay).as_posix() for p in paths.files_under(base.overlay)
    }
    assert set(series.touched) == overlay
    assert series.test_files == sorted(
        p for p in created if p.startswith("tests/") and "/test_" in p
    )
    assert series.hunks == sum(p.hunks for p in series.patches)
    for path in series.touched:
        first = next(p for p in series.patches if path in {d.path for d in p.files})
        assert series.creator(path) == first.name


@pytest.mark.parametrize("base", bases.load_bases(), ids=lambda b: b.version)
def test_series_identity_and_manifest(base: bases.Base) -> None:
    series = Series.load(base)
    assert re.fullmatch(r"[0-9a-f]{64}", series.id)
    assert series.short_id == series.id[:SHORT_ID_LENGTH]
    assert series.version.startswith(f"{base.version}+glm5next.")
    manifest = json.loads(series.manifest())
    assert manifest["id"] == series.id and manifest["version"] == series.version
    assert [p["sha256"] for p in manifest["patches"]] == [
        file_sha256(p.path) for p in series.patches
    ]
    assert SERIES_FILE == "vllm/glm5next_series.json"
    problems, last = series.blob_chain()
    assert problems == [] and set(last) == set(series.touched)


def test_every_command_registers_its_own_parser() -> None:
    parser = cli.build_parser()
    choices = next(a.choices for a in parser._actions if isinstance(a.choices, dict))
    assert choices is not None
    assert len(choices) == len(COMMANDS) + len(report.REPORTS) - 1
    for command in COMMANDS:
        assert callable(command.register) and callable(command.run)


def test_run_without_a_command_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [sys.executable, str(paths.REPO / "scripts" / "patchset"), "run"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert done.stderr.startswith("patchset: error: run: no command given")


def test_apply_is_imported_only_where_patches_are_applied() -> None:
    importers = {name for name, deps in import_graph().items() if "apply" in deps}
    # `commands`: the `apply` command's module, which applies; `check` and
    # `worktree` (refresh) apply the series to the base files as `apply` does.
    assert importers == {"check", "commands", "runner", "testcmd", "wheel", "worktree"}


def python_files() -> list[Path]:
    return sorted(TOOL.rglob("*.py"))


def test_git_runs_only_through_gitutil() -> None:
    for path in python_files():
        if path.name == "gitutil.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "git":
                raise AssertionError(f"{path}: names the git executable")


def test_one_identity_and_one_sha256_helper() -> None:
    for path in python_files():
        text = path.read_text()
        if path.name != "gitutil.py":
            assert "user.email=" not in text, path
        if path.name != "digests.py":
            assert "file_digest(" not in text, path
            assert "urlsafe_b64encode" not in text, path
