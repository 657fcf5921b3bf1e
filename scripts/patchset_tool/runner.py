# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Running a command against a base's patched tree or its pristine install."""

import os
import subprocess
import sys
from pathlib import Path

from . import apply, distinfo, envmgr, paths
from .bases import Base

TREE_VAR = "GLM5NEXT_PATCHSET_TREE"


def vllm_cache_root(tree: str) -> str:
    """The VLLM_CACHE_ROOT of one tree. vLLM keeps one
    model-info file per model class, keyed by the hash of its package, and
    inspects a class it has no matching file for in a fresh subprocess that
    imports vLLM again (~10 s). Trees whose glm5next package differs (each
    base, pristine or patched) would overwrite each other's file; one cache
    per tree keeps each warm."""
    return str(paths.cache_root() / "vllm-cache" / tree)


def tree_env(
    python: Path, base: Base, pristine: bool, suite: bool = False
) -> dict[str, str]:
    """Environment that puts `base`'s managed venv on PATH, its patched
    tree (or nothing, when `pristine`) first on sys.path, and vLLM on its
    CPU platform; with `suite`, the verification suite's folder on sys.path
    too (its public helpers, `import glm5next_verify`, for the reports)."""
    env = dict(os.environ)
    bin_dir = str(python.parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(python.parent.parent)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env[TREE_VAR] = f"{base.version}-{'pristine' if pristine else 'patched'}"
    env["VLLM_CACHE_ROOT"] = vllm_cache_root(env[TREE_VAR])
    # Importing vLLM 0.34.0 imports humming, which then starts two Python
    # processes that build its CUDA launchers in the background: on a CPU
    # host they build nothing, but cost seconds of CPU per vLLM import.
    env["HUMMING_DISABLE_PARALLEL_BUILD"] = "1"
    env.pop("PYTHONHOME", None)
    # Let the patched tree and the tests keep their bytecode between runs;
    # importing vLLM from source every time costs tens of seconds.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    extra = [] if pristine else [str(base.patched_tree())]
    # PYTHONPATH comes before site-packages: drop any entry that holds
    # another vllm (a patched tree a parent `patchset run` put there, a
    # checkout of the user's), so that the command reaches the tree asked for.
    inherited = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not _holds_vllm(Path(p))
    ]
    helpers = [str(paths.SUITE)] if suite else []
    env["PYTHONPATH"] = os.pathsep.join(
        [*extra, str(paths.REPO / "scripts"), *helpers, *inherited]
    )
    return env


def _holds_vllm(folder: Path) -> bool:
    """Whether importing `vllm` with `folder` on sys.path would find it there."""
    return (
        (folder / apply.STAMP).is_file()
        or (folder / "vllm").is_dir()
        or (folder / "vllm.py").is_file()
    )


SUITE_PRISTINE_VAR = "GLM5NEXT_VERIFY_PRISTINE_ROOT"
SUITE_PATCHED_VAR = "GLM5NEXT_VERIFY_PATCHED_ROOT"


def suite_env(python: Path, base: Base) -> dict[str, str]:
    """The environment of the verification suite (tests/models/glm5next) for
    `base`: `tree_env` of its patched tree, plus where its two trees are,
    each with its own vLLM cache (the names `glm5next_verify` reads):
    the pristine install's site-packages and the patched tree."""
    env = tree_env(python, base, pristine=False)
    roots = {
        SUITE_PRISTINE_VAR: ("pristine", distinfo.default_install(base).site),
        SUITE_PATCHED_VAR: ("patched", base.patched_tree()),
    }
    for var, (tree, root) in roots.items():
        env[var] = str(root)
        env[f"{var}_CACHE"] = vllm_cache_root(f"{base.version}-{tree}")
    return env


def ensure_patched_tree(base: Base) -> None:
    """Re-apply `base`'s series when its patched tree is missing or stale."""
    install = distinfo.default_install(base)
    dest = base.patched_tree()
    if not apply.is_current(dest, install, base):
        # On stderr: stdout belongs to the command (`capacity --json`).
        print(
            f"patched tree {dest} is missing or stale; applying the series",
            file=sys.stderr,
            flush=True,
        )
        print(apply.apply_to_package(base, dest, install), file=sys.stderr, flush=True)


def run(
    command: list[str],
    base: Base,
    pristine: bool,
    cwd: Path | None = None,
    suite: bool = False,
) -> int:
    """Run `command` against one tree of `base`, in `cwd` (default: the
    caller's working directory), with the suite's helpers when `suite`
    (see `tree_env`); return its exit status."""
    python = envmgr.env_python(base)
    assert python is not None
    if not pristine:
        ensure_patched_tree(base)
    return subprocess.run(
        command, env=tree_env(python, base, pristine, suite), cwd=cwd
    ).returncode
