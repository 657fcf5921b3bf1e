# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Faults and hands: every bad input, signal and broken machine gets one
short line and the right exit status, checked before anything is written;
help says what each command does."""

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from projectkit import PROBE, REPO, Project, in_mount_namespace, needs_unshare

from patchset_tool import cli, trees


def tool(*args: str, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "patchset"), *args],
        cwd=REPO,
        env=env or {**os.environ, "PYTHONPATH": str(REPO / "scripts")},
        capture_output=True,
        text=True,
    )


def assert_one_error(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, result.stderr
    return errors[0]


# --- D4: the reports' arguments, Ctrl-C while the parser is built ---------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["capacity", "--pristine", "--tp", "0"], "--tp: 0 is not above 0"),
        (["capacity", "--pristine", "--budget-gib", "-5"], "--budget-gib: -5"),
        (["capacity", "--pristine", "--budget-gib", "inf"], "inf is not finite"),
        (
            ["coverage", "--pristine", "--config", "/nonexistent.json"],
            "/nonexistent.json: No such file",
        ),
        (
            ["capacity", "--max-num-batched-tokens", "9" * 30],
            "is not below 2**31",
        ),
    ],
    ids=["tp-0", "budget-negative", "budget-inf", "config-missing", "tokens-huge"],
)
def test_report_arguments_are_checked_in_the_parser(
    argv: list[str], words: str
) -> None:
    result = tool(*argv)
    assert words in assert_one_error(result, code=2)


@pytest.mark.parametrize("report", ["coverage", "capacity"])
@pytest.mark.parametrize("own", ["--pristine", "--base=0.33.0"])
def test_a_batch_case_with_the_tools_own_option_is_refused(
    tmp_path: Path, report: str, own: str
) -> None:
    batch = tmp_path / "cases.json"
    batch.write_text(f'[["--json"], ["{own}"]]')
    result = tool(report, "--batch", str(batch))
    assert f"case 2 gives {own}" in assert_one_error(result)


def test_ctrl_c_while_the_parser_is_built(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    monkeypatch.setattr(cli, "stop_on_signals", lambda: None)
    assert cli.main(["check"]) == 128 + signal.SIGINT
    assert "interrupted" in capsys.readouterr().err


# --- D5: a full disk is one short line -----------------------------------------


def test_a_full_disk_is_one_short_line() -> None:
    errors = [
        (f"/src/{n}.py", f"/full/{n}.py", f"[Errno 28] No space left on device: {n}")
        for n in range(20000)
    ]
    text = cli.describe_fault(shutil.Error(errors))
    assert text.startswith("no space left on the device")
    assert len(text) < 400
    plain = OSError(errno.ENOSPC, "No space left on device", "/full/x")
    assert cli.describe_fault(plain).startswith("no space left on the device")


@needs_unshare
def test_apply_onto_a_full_disk(project: Project, series: Path, tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    script = (
        f"mount -t tmpfs -o size=2m tmpfs {small} && "
        f"{sys.executable} scripts/patchset apply --dest {small}/tree; rc=$?; "
        f"echo LEFT:$(ls -A {small}); exit $rc"
    )
    result = in_mount_namespace(script, project.root, project.env)
    line = assert_one_error(result)
    assert "no space left on the device" in line and len(line) < 500
    assert result.stdout.rsplit("LEFT:", 1)[-1].split() == [".tree.lock"]


# --- D6: a damaged manifest is a damaged tree, rebuilt -------------------------


def test_a_damaged_manifest_is_rebuilt(project: Project, series: Path) -> None:
    assert project.patchset("apply").returncode == 0
    manifest = project.patched / trees.MANIFEST
    manifest.write_text("garbage\n" + manifest.read_text())
    result = project.patchset("apply")
    assert result.returncode == 0, result.stderr
    assert "already up to date" not in result.stdout
    assert trees.damage(project.patched) == []


def test_run_rebuilds_a_tree_with_a_file_edited_to_the_same_size(
    project: Project, series: Path
) -> None:
    assert project.patchset("apply").returncode == 0
    edited = project.patched / PROBE
    good = edited.read_bytes()
    edited.write_bytes(good.replace(b"42", b"24"))
    result = project.patchset("run", "--", "python", "-c", "")
    assert result.returncode == 0, result.stderr
    assert "missing or stale; applying the series" in result.stderr
    assert edited.read_bytes() == good


# --- D7, D11, D12: arguments checked first; messages; help ----------------------


@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_test_jobs_is_checked_before_anything(project: Project, jobs: str) -> None:
    result = project.patchset("test", "--jobs", jobs)
    assert "--jobs" in assert_one_error(result, code=2)
    assert not (project.root / "build").exists()


def test_a_huge_base_is_not_echoed_whole() -> None:
    result = tool("env", "--base", "9" * 100_000)
    assert_one_error(result)
    assert len(result.stderr) < 2000


def test_worktree_onto_the_patched_tree_says_what_is_there(
    project: Project, series: Path, history: Path
) -> None:
    assert project.patchset("apply").returncode == 0
    before = sorted(p.name for p in project.patched.iterdir())
    result = project.patchset("worktree", "--dest", str(project.patched))
    line = assert_one_error(result)
    assert "holds the tool's patched-tree" in line and "nothing was changed" in line
    assert sorted(p.name for p in project.patched.iterdir()) == before


def test_help_says_what_the_commands_do() -> None:
    assert "default: every declared base" in " ".join(
        tool("test", "--help").stdout.split()
    )
    assert "the release to port to" in tool("rebase", "--help").stdout
    assert "the patch to regenerate" in tool("refresh", "--help").stdout
    apply_help = " ".join(tool("apply", "--help").stdout.split())
    assert "needs the environment" in apply_help
    bogus = tool("apply", "--bogus")
    assert bogus.returncode == 2
    assert bogus.stderr.startswith("usage: patchset apply")
    assert "unrecognized arguments: --bogus" in bogus.stderr


def test_apply_check_creates_no_environment(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "scripts"),
        "GLM5NEXT_PATCHSET_CACHE": str(cache),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "1",
    }
    result = tool("apply", "--check", env=env)
    assert "no managed environment" in assert_one_error(result)
    assert not cache.exists() or not any(cache.rglob("*"))


# --- D8, D14: run -------------------------------------------------------------------


def test_run_pristine_ignores_an_inherited_vllm(
    project: Project, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    (other / "vllm").mkdir(parents=True)
    (other / "vllm" / "__init__.py").write_text("")
    env = {**project.env, "PYTHONPATH": str(other)}
    code = "import importlib.util as u; print(u.find_spec('vllm').origin)"
    result = project.patchset("run", "--pristine", "--", "python", "-c", code, env=env)
    assert result.returncode == 0, result.stderr
    assert str(other) not in result.stdout
    assert "site-packages" in result.stdout


def test_run_of_a_killed_command_exits_128_plus_the_signal(project: Project) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    result = project.patchset("run", "--pristine", "--", "python", "-c", code)
    assert result.returncode == 128 + signal.SIGTERM


# --- D17: a C locale without UTF-8 --------------------------------------------------


def test_apply_check_in_an_ascii_locale(project: Project, series: Path) -> None:
    env = {
        **project.env,
        "LC_ALL": "C",
        "PYTHONCOERCECLOCALE": "0",
        "PYTHONUTF8": "0",
    }
    result = project.patchset("apply", "--check", env=env)
    assert result.returncode in (0, 1), result.stderr
    assert "codec" not in result.stderr and "Traceback" not in result.stderr
    assert "(--check: nothing written)" in result.stdout
