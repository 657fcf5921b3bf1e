# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The managed environment: a venv with vllm==0.33.0 and the test tools.

The venv lives in the shared cache, keyed by a hash of the interpreter
version and `ci/requirements/vllm.txt`, so every clone on a machine reuses
one 9 GB install. The light tool pins (`tools.txt`) are synced into it and
recorded by their own hash, so bumping a linter does not reinstall vLLM.
"""

import contextlib
import fcntl
import hashlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from . import paths
from .errors import PatchsetError

COMPLETE = ".patchset-complete"
FREE_GIB_NEEDED = 14
FAILURE_HINTS = [
    ("No space left on device", "the disk filled up during the install"),
    ("No matching distribution", "the package registry does not offer a pin"),
    ("Could not find a version", "the package registry does not offer a pin"),
    ("Network is unreachable", "no package registry can be reached"),
    ("Failed to establish a new connection", "no package registry can be reached"),
    ("Temporary failure in name resolution", "no package registry can be reached"),
    ("ReadTimeoutError", "the package registry timed out"),
]


def _digest(*parts: bytes) -> str:
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def python_tag() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}"


def env_dir() -> Path:
    """The venv directory for the current requirements and interpreter."""
    vllm_req = (paths.REQUIREMENTS / "vllm.txt").read_bytes()
    return (
        paths.cache_root() / "envs" / f"vllm-{_digest(python_tag().encode(), vllm_req)}"
    )


def tools_stamp() -> str:
    return "tools-" + _digest((paths.REQUIREMENTS / "tools.txt").read_bytes())


def env_python(require: bool = True) -> Path | None:
    """The managed python, if the environment is complete."""
    env = env_dir()
    python = env / "bin" / "python"
    ready = (env / COMPLETE).is_file() and (env / tools_stamp()).is_file()
    if ready and python.exists():
        return python
    if require:
        raise PatchsetError(
            f"no managed environment at {env} (or it is incomplete); "
            "run `scripts/patchset setup`"
        )
    return None


def site_packages(python: Path) -> Path:
    """site-packages of a venv, found on disk without starting Python."""
    found = sorted((python.parent.parent / "lib").glob("python3.*/site-packages"))
    if not found:
        raise PatchsetError(f"{python}: venv has no lib/python3.*/site-packages")
    return found[0]


@contextlib.contextmanager
def _locked(env: Path) -> Iterator[None]:
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.with_name(env.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another setup of {env} to finish...", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _check_disk(where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free / 2**30
    if free < FREE_GIB_NEEDED:
        raise PatchsetError(
            f"not enough disk for the environment: {free:.1f} GiB free at "
            f"{where}, about {FREE_GIB_NEEDED} GiB needed; free space or set "
            f"{paths.CACHE_ENV_VAR} to a directory on a larger disk"
        )


def _pip_install(python: Path, requirements: Path) -> None:
    """Run pip, echoing its progress lines; explain a failure."""
    command = [
        str(python),
        "-m",
        "pip",
        "install",
        "--progress-bar",
        "off",
        "--disable-pip-version-check",
        "-r",
        str(requirements),
    ]
    start = time.monotonic()
    tail: list[str] = []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-40:]
            if line.startswith(
                ("Collecting", "Downloading", "Installing", "Successfully", "ERROR")
            ):
                print(
                    f"  [{time.monotonic() - start:5.0f}s] {line.rstrip()[:110]}",
                    flush=True,
                )
    if proc.returncode:
        text = "\n".join(tail)
        reason = next(
            (why for needle, why in FAILURE_HINTS if needle in text), "pip failed"
        )
        raise PatchsetError(
            f"installing {requirements.name} failed: {reason}.\n"
            f"Last pip output:\n{text}\n"
            "Fix the cause and run `scripts/patchset setup` again; it resumes "
            "in the same environment."
        )


def setup() -> Path:
    """Create or reuse the managed environment; return its python."""
    env = env_dir()
    python = env / "bin" / "python"
    with _locked(env):
        if not (env / COMPLETE).is_file():
            _check_disk(env.parent)
            print(
                f"setting up the environment in {env} (vllm and torch, ~9 GB)",
                flush=True,
            )
            if not python.exists():
                subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
            _pip_install(python, paths.REQUIREMENTS / "vllm.txt")
            (env / COMPLETE).write_text((paths.REQUIREMENTS / "vllm.txt").read_text())
        stamp = env / tools_stamp()
        if not stamp.is_file():
            print("installing the pinned test tools", flush=True)
            _pip_install(python, paths.REQUIREMENTS / "tools.txt")
            stamp.write_text((paths.REQUIREMENTS / "tools.txt").read_text())
    return python
