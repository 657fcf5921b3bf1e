# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`bisect-run`: the script for `git bisect run` against vLLM main.

Exit codes follow git bisect: 0 good, 1 bad, 125 skip (the series does not
apply at this commit, or vLLM cannot be imported there). The checkout's
Python runs over the compiled extensions of the managed vllm install
(linked into a scratch worktree), as with vLLM's precompiled wheels, so
this bisects Python changes, which is what the series touches.
"""

import os
import subprocess
from pathlib import Path

from . import apply, envmgr, gitutil, paths, runner
from .errors import PatchsetError
from .series import load_series

SKIP = 125


def _link_extensions(install_package: Path, tree: Path) -> int:
    linked = 0
    for so in install_package.rglob("*.so"):
        target = tree / "vllm" / so.relative_to(install_package)
        if target.parent.is_dir() and not target.exists():
            os.symlink(so, target)
            linked += 1
    return linked


def bisect_run(src: Path, pytest_args: list[str]) -> int:
    """Apply the series at HEAD of `src` in a scratch worktree and run the
    model tests there; return 0, 1 or 125."""
    python = envmgr.env_python()
    assert python is not None
    head = gitutil.require_clean_checkout(src)[:12]
    patches = load_series(paths.PATCHES)
    with apply.scratch_worktree(src) as scratch:
        try:
            gitutil.am_series(scratch, patches)
        except PatchsetError as exc:
            print(f"bisect-run: {head}: series does not apply, skipping (125)\n{exc}")
            return SKIP
        install = apply.default_install()
        _link_extensions(install.package, scratch)
        env = runner.tree_env(python, base=True)
        env["PYTHONPATH"] = os.pathsep.join([str(scratch), env["PYTHONPATH"]])
        probe = subprocess.run(
            [str(python), "-c", "import vllm"],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
        )
        if probe.returncode:
            print(
                f"bisect-run: {head}: vllm does not import over the "
                f"{paths.VLLM_VERSION} extensions, skipping (125)\n"
                f"{probe.stderr[-2000:]}"
            )
            return SKIP
        # The test files the series adds, with only their own conftest:
        # vLLM's tests/conftest.py needs the whole upstream test stack.
        tests = [
            d.path
            for p in patches
            for d in p.files
            if d.is_new and d.path.startswith(f"{paths.MODEL_TESTS}/test_")
        ]
        command = [
            str(python),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--confcutdir={paths.MODEL_TESTS}",
            *tests,
            *pytest_args,
        ]
        result = subprocess.run(command, cwd=scratch, env=env).returncode
    verdict = 0 if result == 0 else 1 if result in (1, 2) else SKIP
    print(f"bisect-run: {head}: pytest exited {result}; reporting {verdict}")
    return verdict
