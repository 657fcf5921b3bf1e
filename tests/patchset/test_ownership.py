# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The one ownership rule (`trees.claim_folder`, `trees.claim_file`): the
tool writes only into what it made, never into an installation at any
depth, and removes only what it marked; `verify-install` never reports
code it could not check."""

import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from projectkit import REPO, Project

from patchset_tool import envmgr, trees, wheel
from patchset_tool.bases import get_base
from patchset_tool.digests import record_hash
from patchset_tool.errors import PatchsetError
from patchset_tool.series import Series


def tool(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO):
    """`scripts/patchset ARGS` on this repository."""
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "patchset"), *args],
        cwd=cwd,
        env=env or {**os.environ, "PYTHONPATH": str(REPO / "scripts")},
        capture_output=True,
        text=True,
    )


def one_line_refusal(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def pip_target(root: Path) -> Path:
    """A `pip install --target` folder holding vllm."""
    (root / "vllm" / "model_executor").mkdir(parents=True)
    (root / "vllm" / "_version.py").write_text("__version__ = '9.9.9'\n")
    (root / "vllm-9.9.9.dist-info").mkdir()
    (root / "vllm-9.9.9.dist-info" / "RECORD").write_text("")
    return root


# --- the rule itself ----------------------------------------------------------


@pytest.mark.parametrize(
    "below", ["vllm/model_executor/new", "vllm/model_executor/a/b/c"]
)
def test_deep_inside_a_pip_target_package_is_refused(
    tmp_path: Path, below: str
) -> None:
    target = pip_target(tmp_path / "target")
    with pytest.raises(PatchsetError, match="installed package"):
        trees.claim_folder(target / below, "--dest", kind="patched-tree")


def test_a_symlink_into_site_packages_is_refused(tmp_path: Path) -> None:
    site = tmp_path / "env" / "lib" / "python3.11" / "site-packages"
    (site / "pkg").mkdir(parents=True)
    build = tmp_path / "repo" / "build"
    build.parent.mkdir()
    build.symlink_to(site / "pkg")
    with pytest.raises(PatchsetError, match="Python installation"):
        trees.claim_folder(build / "0.34.0" / "vllm-patched", "--dest", "tree")
    with pytest.raises(PatchsetError, match="Python installation"):
        trees.claim_file(build / "pr-description.md", "--pr-description")
    assert list((site / "pkg").iterdir()) == []


def test_a_tree_of_another_kind_is_not_replaced(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    trees.mark(tree, "patched-tree")
    trees.claim_folder(tree, "--dest", kind="patched-tree")
    with pytest.raises(PatchsetError, match="holds the tool's patched-tree"):
        trees.claim_folder(tree, "--dist", kind="dist")
    with pytest.raises(PatchsetError, match="holds the tool's patched-tree"):
        trees.refuse_foreign(tree, "--dest")


def test_a_file_is_replaced_only_as_the_tool_wrote_it(tmp_path: Path) -> None:
    target = tmp_path / "out" / "pr-description.md"
    trees.claim_file(target, "--pr-description")  # absent: fine
    target.parent.mkdir()
    target.write_text("mine\n")
    with pytest.raises(PatchsetError, match="did not write"):
        trees.claim_file(target, "--pr-description")
    target.write_text("the tool's\n")
    trees.record_file(target)
    trees.claim_file(target, "--pr-description")
    target.write_text("the tool's, then edited by hand\n")
    with pytest.raises(PatchsetError, match="changed since"):
        trees.claim_file(target, "--pr-description")


def test_stale_staging_is_removed_only_when_marked_and_unheld(tmp_path: Path) -> None:
    target = tmp_path / "tree"
    lookalike = tmp_path / f".tree{trees.STAGING}mine"
    lookalike.mkdir()
    (lookalike / "notes.txt").write_text("keep\n")
    stale = trees.make_staging(target)  # a killed run's
    with trees.staging(target) as live:
        trees.remove_stale(target)
        assert live.is_dir()
    assert not stale.exists() or stale == live
    trees.remove_stale(target)
    assert not stale.exists()
    assert (lookalike / "notes.txt").read_text() == "keep\n"


# --- apply ----------------------------------------------------------------------


def test_apply_refuses_a_folder_deep_in_a_pip_target(
    project: Project, series: Path, tmp_path: Path
) -> None:
    target = pip_target(tmp_path / "target")
    dest = target / "vllm" / "model_executor" / "patched"
    result = project.patchset("apply", "--dest", str(dest))
    one_line_refusal(result, str(dest), "nothing was changed")
    assert not dest.exists()
    assert sorted(p.name for p in (target / "vllm" / "model_executor").iterdir()) == []


def test_apply_keeps_neighbours_that_look_like_its_staging(
    project: Project, series: Path
) -> None:
    build = project.build()
    build.mkdir(parents=True)
    mine = [build / ".vllm-patched.staging-notes", build / ".vllm-patched.old-1"]
    for folder in mine:
        folder.mkdir()
        (folder / "keep.txt").write_text("the user's\n")
    killed = trees.make_staging(project.patched)  # what a killed apply leaves
    result = project.patchset("apply")
    assert result.returncode == 0, result.stderr
    for folder in mine:
        assert (folder / "keep.txt").read_text() == "the user's\n"
    assert not killed.exists()


# --- worktree ---------------------------------------------------------------------


def test_worktree_keeps_neighbours_that_look_like_its_staging(
    project: Project, series: Path, history: Path, tmp_path: Path
) -> None:
    """Harm (issue 27, folders beside a destination): `worktree --dest`
    removed `.NAME.staging`, a folder beside it the tool never made."""
    dest = tmp_path / "wt"
    mine = [tmp_path / ".wt.staging", tmp_path / f".wt{trees.STAGING}notes"]
    for folder in mine:
        folder.mkdir()
        (folder / "keep.txt").write_text("the user's\n")
    killed = trees.make_staging(dest)  # what a killed worktree run leaves
    result = project.patchset("worktree", "--dest", str(dest))
    assert result.returncode == 0, result.stderr
    assert (dest / ".git").is_dir()
    for folder in mine:
        assert (folder / "keep.txt").read_text() == "the user's\n"
    assert not killed.exists()


# --- build ------------------------------------------------------------------------


def offline_env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO / "scripts"),
        "GLM5NEXT_PATCHSET_CACHE": str(cache),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "1",
    }


def small_upstream_wheel(cache: Path) -> None:
    """A cut-down 'upstream wheel' of the primary base in `cache`: the
    installed files the series touches, _version.py and the dist-info,
    with a RECORD of their own (the build reads nothing else)."""
    base = get_base()
    python = envmgr.env_python(base)
    assert python is not None
    site = envmgr.site_packages(python)
    dist_info = next(site.glob(f"vllm-{base.version}.dist-info"))
    names = [p for p, existed in Series.load(base).touched.items() if existed]
    names = [p for p in names if p.startswith("vllm/")] + ["vllm/_version.py"]
    buffer = io.BytesIO()
    record = io.StringIO()
    rows = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as out:
        for name in names:
            data = (site / name).read_bytes()
            out.writestr(name, data)
            rows.writerow([name, record_hash(data), len(data)])
        for name in ("METADATA", "WHEEL"):
            data = (dist_info / name).read_bytes()
            out.writestr(f"{dist_info.name}/{name}", data)
            rows.writerow([f"{dist_info.name}/{name}", record_hash(data), len(data)])
        rows.writerow([f"{dist_info.name}/RECORD", "", ""])
        out.writestr(f"{dist_info.name}/RECORD", record.getvalue())
    folder = cache / "wheels"
    folder.mkdir(parents=True)
    name = wheel.upstream_wheel_name(base.version)
    (folder / name).write_bytes(buffer.getvalue())
    digest = hashlib.sha256(buffer.getvalue()).hexdigest()
    (folder / f"{name}.sha256").write_text(digest + "\n")


def test_build_refuses_a_foreign_non_empty_dist(tmp_path: Path) -> None:
    dist = tmp_path / "mine"
    dist.mkdir()
    (dist / "notes.txt").write_text("keep me\n")
    result = tool("build", "--dist", str(dist), env=offline_env(tmp_path / "cache"))
    one_line_refusal(result, str(dist), "nothing was changed")
    assert sorted(p.name for p in dist.iterdir()) == ["notes.txt"]


def test_build_keeps_files_that_look_like_its_partials(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    small_upstream_wheel(cache)
    dist = tmp_path / "dist"
    dist.mkdir()
    trees.mark(dist, wheel.DIST_KIND)
    lookalike = dist / ".vllm-mine.whl.partial"
    lookalike.write_text("the user's\n")
    result = tool("build", "--dist", str(dist), env=offline_env(cache))
    assert result.returncode == 0, result.stderr
    assert lookalike.read_text() == "the user's\n"
    built = [p.name for p in dist.iterdir() if p.suffix == ".whl"]
    assert len(built) == 1
    assert sorted(p.name for p in dist.iterdir()) == sorted(
        [trees.MARKER, lookalike.name, *built]
    )
    # The next build replaces its own wheel in its own folder.
    again = tool("build", "--dist", str(dist), env=offline_env(cache))
    assert again.returncode == 0, again.stderr


def test_build_prints_install_commands_quoted(tmp_path: Path) -> None:
    path = tmp_path / "a dist; rm -rf x" / "vllm.whl"
    built = wheel.BuiltWheel(path, 1, 1.0, get_base(), 2, 3, "abc")
    text = str(built)
    assert f"uv pip install --no-deps '{path}'" in text
    assert f"  pip install --no-deps '{path}'" in text


def test_sigterm_during_a_wheel_write_leaves_nothing(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    code = (
        "import os, signal, sys, time; from pathlib import Path;"
        "sys.path.insert(0, sys.argv[1]);"
        "from patchset_tool import cli, wheel;"
        "cli.stop_on_signals();"
        "\ndef write(p):\n"
        "    p.write_bytes(b'x' * 4096); os.kill(os.getpid(), signal.SIGTERM);"
        " time.sleep(5)\n"
        "try:\n"
        "    wheel._write_atomically(Path(sys.argv[2]) / 'v.whl', write, 1)\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "scripts"), str(dist)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip() == "stopped", result.stderr
    assert not dist.exists()


# --- verify-install ------------------------------------------------------------


def fake_install(site: Path, extra_record: list[list[str]] | None = None) -> Path:
    """A site-packages with vllm 0.34.0: one package file, listed in RECORD."""
    init = site / "vllm" / "__init__.py"
    init.parent.mkdir(parents=True)
    init.write_text("x = 1\n")
    dist = site / "vllm-0.34.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Name: vllm\nVersion: 0.34.0\n")
    rows = [["vllm/__init__.py", record_hash(b"x = 1\n"), "6"]]
    with open(dist / "RECORD", "w", newline="") as handle:
        csv.writer(handle).writerows(rows + (extra_record or []))
    return site


def test_verify_install_refuses_an_editable_install(tmp_path: Path) -> None:
    site = tmp_path / "site"
    dist = site / "vllm-0.34.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Name: vllm\nVersion: 0.34.0\n")
    (site / "__editable__.vllm-0.34.0.pth").write_text("/home/me/vllm\n")
    (dist / "direct_url.json").write_text(
        json.dumps({"url": "file:///home/me/vllm", "dir_info": {"editable": True}})
    )
    (dist / "RECORD").write_text(
        "__editable__.vllm-0.34.0.pth,sha256=x,14\nvllm-0.34.0.dist-info/RECORD,,\n"
    )
    result = tool("verify-install", str(site))
    one_line_refusal(result, "editable", "cannot verify")
    assert "match RECORD" not in result.stdout


@pytest.mark.parametrize(
    "series", ["[1, 2]", '{"base": "0.34.0", "patches": []}', "{not json"]
)
def test_verify_install_with_a_malformed_series_file(
    tmp_path: Path, series: str
) -> None:
    site = fake_install(tmp_path / "site")
    (site / "vllm" / "glm5next_series.json").write_text(series)
    result = tool("verify-install", str(site))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    assert "glm5next_series.json" in result.stderr


def test_verify_install_with_an_over_long_record_field(tmp_path: Path) -> None:
    site = fake_install(tmp_path / "site", [["vllm/" + "x" * 200_000, "", ""]])
    result = tool("verify-install", str(site))
    one_line_refusal(result, "RECORD")


def test_verify_install_with_a_hanging_interpreter(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nsleep 30\n")
    python.chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "scripts"),
        "PATCHSET_PYTHON_TIMEOUT": "1",
    }
    result = tool("verify-install", str(python), env=env)
    one_line_refusal(result, str(python), "did not name its site-packages")
