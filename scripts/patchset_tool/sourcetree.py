# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A base's source checkout, runnable as upstream CI runs its tests.

The release's own source tree (with `tests/conftest.py` and upstream's
tests) gets the installed wheel's compiled extensions linked in, as vLLM's
precompiled-wheel workflow does, so `pytest -v -s models/glm5next` can run
from its `tests/` folder exactly as the `glm5next-unit-tests` step does.
"""

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from . import gitutil, paths, runner, upstream
from .bases import Base
from .distinfo import default_install
from .series import Series


def link_extensions(install_package: Path, tree: Path) -> int:
    """Symlink the install's compiled extensions into the checkout `tree`
    (replacing a link to another install); return how many were linked."""
    linked = 0
    for so in install_package.rglob("*.so"):
        target = tree / "vllm" / so.relative_to(install_package)
        if not target.parent.is_dir():
            continue
        if target.is_symlink() and Path(os.readlink(target)) != so:
            target.unlink()
        if not target.exists() and not target.is_symlink():
            os.symlink(so, target)
            linked += 1
    return linked


@contextlib.contextmanager
def checkout_for_tests(base: Base, patched: bool) -> Iterator[Path]:
    """A checkout of `base`'s release with its compiled extensions: with the
    series applied (`patched`), or pristine with only the series' test files
    added (their conftest.py too), so that each fix shows red there.

    It is kept between runs in build/<version>/test-checkout-<tree>: each
    run resets it to the release tag and removes every untracked file but
    the bytecode and the linked extensions. git leaves unchanged files (and
    so their mtimes) alone, so the bytecode of the ~5,800 files stays valid
    and vLLM is not compiled again on every run (~20 s of CPU each)."""
    tree = "patched" if patched else "pristine"
    series = Series.load(base)
    clone = base.build_dir() / f"test-checkout-{tree}"
    clone.parent.mkdir(parents=True, exist_ok=True)
    with open(clone.with_name(clone.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        history = upstream.release_history()
        if not _is_clone_of(clone, history):
            shutil.rmtree(clone, ignore_errors=True)
            gitutil.git(
                "clone",
                "--quiet",
                "--shared",
                str(history),
                str(clone),
                cwd=clone.parent,
            )
        gitutil.git("am", "--abort", cwd=clone, check=False)
        gitutil.git("checkout", "--quiet", "--force", "--detach", base.tag, cwd=clone)
        gitutil.git("clean", "-ffdxq", "-e", "__pycache__", "-e", "*.so", cwd=clone)
        if patched:
            gitutil.am_series(clone, series.patches)
        else:
            for path in (p for p in series.created if p.startswith("tests/")):
                (clone / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(base.copy_of(path), clone / path)
        link_extensions(default_install(base).package, clone)
        yield clone


def _is_clone_of(clone: Path, history: Path) -> bool:
    """Whether `clone` is a git clone of the release history `history`."""
    if not (clone / ".git").is_dir():
        return False
    origin = gitutil.git("remote", "get-url", "origin", cwd=clone, check=False)
    return origin.returncode == 0 and Path(origin.stdout.strip()) == history


def checkout_env(
    python: Path, base: Base, checkout: Path, tree: str = "checkout"
) -> dict[str, str]:
    """The environment that imports vLLM from `checkout` on the CPU
    platform, with `base`'s managed venv for everything else; `tree` names
    the checkout's own vLLM cache (see `runner.vllm_cache_root`)."""
    env = runner.tree_env(python, base, pristine=True)
    env["VLLM_CACHE_ROOT"] = runner.vllm_cache_root(f"{base.version}-{tree}")
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), env["PYTHONPATH"]])
    return env


def cpu_host_plugin(env: dict[str, str]) -> list[str]:
    """The pytest options that load `glm5next_cpu_host`, the verification
    suite's plugin for what this CPU host lacks that upstream's GPU runners
    have; it puts the suite on `env`'s PYTHONPATH."""
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*path, str(paths.SUITE)])
    return ["-p", "glm5next_cpu_host"]
