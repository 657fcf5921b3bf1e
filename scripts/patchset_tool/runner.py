# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Running a command against the patched tree or the pristine install."""

import os
import subprocess
from pathlib import Path

from . import apply, envmgr, paths

TREE_VAR = "GLM5NEXT_PATCHSET_TREE"


def tree_env(python: Path, base: bool) -> dict[str, str]:
    """Environment that puts the managed venv on PATH, the patched tree (or
    nothing, with `base`) first on sys.path, and vLLM on its CPU platform."""
    env = dict(os.environ)
    bin_dir = str(python.parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(python.parent.parent)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env[TREE_VAR] = "base" if base else "patched"
    env.pop("PYTHONHOME", None)
    # Let the patched tree and the tests keep their bytecode between runs;
    # importing vLLM from source every time costs tens of seconds.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    extra = [] if base else [str(paths.patched_tree())]
    # Drop any patched tree a parent `patchset run` put there, so that a
    # nested `run --base` really reaches the pristine install.
    inherited = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not (Path(p) / apply.STAMP).is_file()
    ]
    env["PYTHONPATH"] = os.pathsep.join(
        [*extra, str(paths.REPO / "scripts"), *inherited]
    )
    return env


def ensure_patched_tree(python: Path) -> None:
    """Re-apply the series when build/ is missing or out of date."""
    install = apply.default_install()
    dest = paths.patched_tree()
    if not apply.is_current(dest, install):
        print(
            f"patched tree {dest} is missing or stale; applying the series", flush=True
        )
        print(apply.apply_to_package(dest, install), flush=True)


def run(command: list[str], base: bool, cwd: Path | None = None) -> int:
    """Run `command` against one tree; return its exit status."""
    python = envmgr.env_python()
    assert python is not None
    if not base:
        ensure_patched_tree(python)
    return subprocess.run(
        command, env=tree_env(python, base), cwd=cwd or paths.REPO
    ).returncode
