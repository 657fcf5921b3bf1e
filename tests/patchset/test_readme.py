# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""README.md says what the tool does: every `scripts/patchset` command in
its ```bash blocks names a real subcommand with options that subcommand
takes; the blocks' commands that need no network and finish in seconds
run and succeed as written; the module picture is the one the imports
give; every figure it states is in docs/measurements.md; and `.ci/run`
runs the steps `ci/pipeline.yaml` lists."""

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from module_floors import import_graph, render

# One worker runs this module, so that the subcommands' help is read once.
pytestmark = pytest.mark.xdist_group("readme")

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MEASUREMENTS = REPO / "docs" / "measurements.md"
PATCHSET = "scripts/patchset"

# The report commands take these options in the tool itself (which tree to
# report on, and `--batch`), before their own options.
REPORTS = ("coverage", "capacity")
REPORT_TOOL_OPTIONS = {"--base", "--pristine", "--batch"}


def fenced_blocks(text: str, language: str) -> list[str]:
    """The bodies of the ```language blocks of a markdown text."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, re.M | re.S)


def command_lines(block: str) -> list[str]:
    """The block's shell lines, continuation lines joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def patchset_calls(line: str) -> list[list[str]]:
    """Each `scripts/patchset` invocation in a shell line, as its arguments
    after `scripts/patchset` (a `$(...)` inside counts as its own)."""
    calls = []
    for inner in re.findall(r"\$\(([^)]*)\)", line):
        calls += patchset_calls(inner)
    words = shlex.split(re.sub(r"\$\([^)]*\)", "SUBST", line), comments=True)
    for i, word in enumerate(words):
        if word == PATCHSET or word.endswith("/" + PATCHSET):
            args = []
            for arg in words[i + 1 :]:
                if arg in ("&&", "||", ";", "|"):
                    break
                args.append(arg)
            calls.append(args)
    return calls


def readme_lines() -> list[str]:
    return [
        line
        for block in fenced_blocks(README.read_text(), "bash")
        for line in command_lines(block)
    ]


def options_of(args: list[str]) -> list[str]:
    """The `--options` of one call (for `run`, those before `--`)."""
    found = []
    for arg in args[1:]:
        if arg == "--":
            break
        if arg.startswith("--"):
            found.append(arg.split("=", 1)[0])
    return found


def run_patchset(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / PATCHSET), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def tool_env() -> dict[str, str]:
    """The environment the README's commands run in here. `coverage` and
    `capacity` apply the series first when the patched tree is stale (the
    test command has applied it before the tool's tests start)."""
    return dict(os.environ)


@cache
def subcommands() -> tuple[str, ...]:
    usage = subprocess.run(
        [sys.executable, str(REPO / PATCHSET), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    choices = re.search(r"\{([a-z,-]+)\}", usage)
    assert choices, usage
    return tuple(choices.group(1).split(","))


@pytest.fixture(scope="module")
def options_by_command(tool_env) -> dict[str, set[str]]:
    """Each subcommand and the options its `--help` names (for the
    reports, with the tool's own options)."""
    found = {}
    for command in subcommands():
        help_run = run_patchset([command, "--help"], tool_env)
        assert help_run.returncode == 0, (command, help_run.stderr)
        found[command] = set(
            re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", help_run.stdout)
        )
        if command in REPORTS:
            found[command] |= REPORT_TOOL_OPTIONS
    return found


def test_every_readme_command_exists_with_its_options(options_by_command):
    calls = [c for line in readme_lines() for c in patchset_calls(line)]
    named = {args[0] for args in calls if args and not args[0].startswith("-")}
    assert named, "README.md has no `scripts/patchset` command in a bash block"
    unknown = sorted(named - set(options_by_command))
    assert not unknown, f"README.md names commands the tool lacks: {unknown}"
    problems = [
        f"`{args[0]}` has no option {option} ({shlex.join(args)})"
        for args in calls
        if args and args[0] in options_by_command
        for option in options_of(args)
        if option not in options_by_command[args[0]]
    ]
    assert not problems, "\n".join(problems)


def test_commands_table_is_the_tool(options_by_command):
    """The README's table of commands lists every subcommand, with options
    it takes and a true answer to "does it take --base"."""
    text = README.read_text()
    section = text[text.index("\n## Commands\n") :]
    section = section[: section.index("\n## ", 1)]
    rows = [
        (name, options.strip(), takes_base.strip())
        for name, options, takes_base in re.findall(
            r"^\| `([a-z-]+)[^`]*` \|(.*?)\|(.*?)\|$", section, re.M
        )
    ]
    assert sorted(name for name, _, _ in rows) == sorted(options_by_command)
    problems = []
    for name, options, takes_base in rows:
        known = options_by_command[name]
        problems += [
            f"{name}: no option {option}"
            for option in re.findall(r"--[a-z][a-z0-9-]*", options)
            if option not in known
        ]
        if takes_base.startswith("yes") != ("--base" in known):
            problems.append(f"{name}: the table says --base {takes_base!r}")
    assert not problems, "\n".join(problems)


def runnable(line: str) -> bool:
    """A README line that needs no network and finishes in seconds here:
    only `scripts/patchset` calls that read (help, check, env, apply
    --check, verify-install), and no placeholder."""
    if not line.startswith(PATCHSET) or re.search(r"<|\.\.\.|\$EDITOR", line):
        return False
    for args in patchset_calls(line):
        words = [a for a in args if a != "--base" and not re.match(r"\d+\.\d+", a)]
        quick = (
            "--help" in words
            or words in (["check"], ["env"], ["apply", "--check"])
            or words == ["verify-install", "SUBST"]
        )
        if not quick:
            return False
    return True


RUNNABLE = [line for line in readme_lines() if runnable(line)]


def test_readme_has_runnable_commands():
    assert len(RUNNABLE) >= 3, RUNNABLE


@pytest.mark.parametrize(
    "line", RUNNABLE, ids=[line.split("#")[0].strip() for line in RUNNABLE]
)
def test_readme_command_runs_as_written(line, tool_env):
    # `scripts/patchset` in the README is this checkout's entry point, run
    # with the interpreter these tests run on.
    env = {**tool_env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"}
    env["PATH"] += tool_env.get("PATH", "")
    proc = subprocess.run(
        ["bash", "-c", line],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr


def test_module_picture_is_the_imports():
    picture = render(import_graph())
    blocks = fenced_blocks(README.read_text(), "text")
    assert picture in blocks, (
        "README.md's module picture is out of date; replace it with the "
        "output of `python3 tests/patchset/module_floors.py`:\n" + picture
    )


def test_module_picture_counts_a_subpackage_as_one_module(tmp_path: Path) -> None:
    """A subpackage is one module: its files' relative and absolute imports
    together, but those among its own files."""
    files = {
        "paths.py": "",
        "runner.py": "from . import paths\n",
        "cli.py": "import importlib\nfrom .runner import run\n",
        "reports/__init__.py": "from . import cli\n",
        "reports/coverage.py": "from ..runner import TREE_VAR\n",
        "reports/capacity.py": "from .coverage import build\n",
        "reports/cli.py": "from . import capacity\nimport patchset_tool.paths\n",
        "reports/__main__.py": "from patchset_tool.reports.cli import main\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_graph(tmp_path) == {
        "cli": {"runner"},
        "paths": set(),
        "runner": {"paths"},
        "reports": {"paths", "runner"},
    }


FIGURE = re.compile(
    r"(?<![\w.,])(?:[+-]?\d+(?:\.\d+)?%"
    r"|\d{1,3}(?:,\d{3})+(?:\.\d+)?"
    r"|\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? (?:s|ms|µs|MB|MiB|GiB|GB|minutes|bytes)\b)"
)


def prose(text: str) -> str:
    """`text` without its fenced blocks and HTML comments."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def test_every_readme_figure_is_in_the_measurements_file():
    figures = set(FIGURE.findall(prose(README.read_text())))
    assert figures, "no figure found in README.md"
    measured = " ".join(MEASUREMENTS.read_text().split())
    missing = sorted(f for f in figures if f not in measured)
    assert not missing, f"README.md figures not in {MEASUREMENTS.name}: {missing}"


def test_ci_run_runs_the_pipeline_steps():
    pipeline = (REPO / "ci" / "pipeline.yaml").read_text()
    steps = re.findall(r"^\s*command:\s*(.+?)\s*$", pipeline, re.M)
    script = (REPO / ".ci" / "run").read_text()
    ran = [line.strip() for line in script.splitlines() if line.startswith(PATCHSET)]
    assert steps and ran == steps


def test_readme_branches_are_exports_default_names():
    """A branch the README pushes is one `export` makes by default:
    glm5next/ and the name of a patch of the primary base's series."""
    patches = {p.stem for p in (REPO / "patches").glob("*/*.patch")}
    named = re.findall(r"glm5next/(\d{4}-[A-Za-z][\w.-]*)", README.read_text())
    assert named
    assert [n for n in named if n not in patches] == []
