# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A base's source checkout, runnable as upstream CI runs its tests.

The release's own source tree (with `tests/conftest.py` and upstream's
tests) gets the installed wheel's compiled extensions linked in, as vLLM's
precompiled-wheel workflow does, so `pytest -v -s models/glm5next` can run
from its `tests/` folder exactly as the `glm5next-unit-tests` step does.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from . import apply, gitutil, paths, runner, upstream
from .bases import Base
from .series import load_series


def link_extensions(install_package: Path, tree: Path) -> int:
    """Symlink the install's compiled extensions into the checkout `tree`;
    return how many were linked."""
    linked = 0
    for so in install_package.rglob("*.so"):
        target = tree / "vllm" / so.relative_to(install_package)
        if target.parent.is_dir() and not target.exists():
            os.symlink(so, target)
            linked += 1
    return linked


def series_test_files(base: Base) -> list[str]:
    """The test files `base`'s series adds, as paths in vLLM's tree."""
    return sorted(
        d.path
        for p in load_series(base.patches)
        for d in p.files
        if d.is_new and d.path.startswith(f"{paths.MODEL_TESTS}/")
    )


@contextlib.contextmanager
def checkout_for_tests(base: Base, patched: bool) -> Iterator[Path]:
    """A scratch checkout of `base`'s release with its compiled extensions:
    with the series applied (`patched`), or pristine with only the series'
    test files added, so that each fix shows red there."""
    with tempfile.TemporaryDirectory(prefix=f"patchset-{base.version}-") as tmp:
        clone = upstream.scratch_clone(Path(tmp), base)
        if patched:
            gitutil.am_series(clone, load_series(base.patches))
        else:
            for path in series_test_files(base):
                (clone / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(base.copy_of(path), clone / path)
        link_extensions(apply.default_install(base).package, clone)
        yield clone


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
