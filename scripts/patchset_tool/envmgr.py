# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The managed environments: one venv per base, made with uv.

Each base's venv lives in the shared cache, keyed by the interpreter version
and the base's own requirements (`ci/requirements/<version>/`). uv is pinned in
`ci/requirements/uv.txt`; the light tool pins (`tools.txt`) are recorded by
their own hash, so bumping a linter does not reinstall vLLM.
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
from .bases import Base
from .errors import PatchsetError

COMPLETE = ".patchset-complete"
FREE_GIB_NEEDED = 14
FAILURE_HINTS = [
    ("No space left on device", "the disk filled up during the install"),
    ("No solution found", "the package index does not offer a pinned version"),
    ("No matching distribution", "the package index does not offer a pin"),
    ("Could not find a version", "the package index does not offer a pin"),
    ("Network is unreachable", "no package index can be reached"),
    ("Failed to establish a new connection", "no package index can be reached"),
    ("dns error", "no package index can be reached"),
    ("Temporary failure in name resolution", "no package index can be reached"),
    ("timed out", "the package index timed out"),
]


def _digest(*parts: bytes) -> str:
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def python_tag() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}"


def _requirement_files(base: Base) -> list[Path]:
    """The base's requirements and, when present, its overrides."""
    files = [base.requirements / "vllm.txt"]
    overrides = base.requirements / "overrides.txt"
    if not files[0].is_file():
        raise PatchsetError(f"{files[0]}: missing; base {base.version} has no pins")
    return files + [overrides] * overrides.is_file()


def env_dir(base: Base) -> Path:
    """The venv directory for `base`'s requirements and this interpreter."""
    key = _digest(
        python_tag().encode(), *(f.read_bytes() for f in _requirement_files(base))
    )
    return paths.cache_root() / "envs" / f"vllm-{base.version}-{key}"


def tools_stamp() -> str:
    return "tools-" + _digest((paths.REQUIREMENTS / "tools.txt").read_bytes())


def env_python(base: Base, require: bool = True) -> Path | None:
    """The managed python of `base`, if its environment is complete."""
    env = env_dir(base)
    python = env / "bin" / "python"
    ready = (env / COMPLETE).is_file() and (env / tools_stamp()).is_file()
    if ready and python.exists():
        return python
    if require:
        raise PatchsetError(
            f"no managed environment for vLLM {base.version} at {env} (or it "
            f"is incomplete); run `scripts/patchset setup --base {base.version}`"
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


def _install(command: list[str], what: str, base: Base | None) -> None:
    """Run an installer, echoing its progress lines; explain a failure."""
    start = time.monotonic()
    tail: list[str] = []
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-40:]
            if line.lstrip().startswith(
                ("Collecting", "Successfully", "Resolved", "Prepared", "Installed")
            ) or line.startswith(("ERROR", "error", "Downloading")):
                print(
                    f"  [{time.monotonic() - start:5.0f}s] {line.rstrip()[:110]}",
                    flush=True,
                )
    if proc.returncode:
        text = "\n".join(tail)
        reason = next(
            (why for needle, why in FAILURE_HINTS if needle in text), "it failed"
        )
        again = f" --base {base.version}" if base else ""
        raise PatchsetError(
            f"installing {what} failed: {reason}.\nLast installer output:\n"
            f"{text}\nFix the cause (a pin the index lacks can be overridden "
            "in the base's ci/requirements/<version>/overrides.txt, with the "
            f"reason) and run `scripts/patchset setup{again}` again; it resumes."
        )


def uv_exe() -> Path:
    """uv, at the version pinned in ci/requirements/uv.txt (installed once)."""
    pin = paths.REQUIREMENTS / "uv.txt"
    home = paths.cache_root() / "tools" / f"uv-{_digest(pin.read_bytes())}"
    uv = home / "bin" / "uv"
    with _locked(home):
        if not (home / COMPLETE).is_file():
            pin_text = pin.read_text(encoding="utf-8").strip()
            print(f"installing uv ({pin_text}) into {home}", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
            _install(
                [
                    str(home / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "-r",
                    str(pin),
                ],
                pin.name,
                None,
            )
            (home / COMPLETE).write_text(pin.read_text(encoding="utf-8"))
    return uv


def _uv_pip_install(python: Path, requirements: list[Path], base: Base) -> None:
    command = [str(uv_exe()), "pip", "install", "--python", str(python)]
    command += ["-r", str(requirements[0])]
    for extra in requirements[1:]:
        flag = "--override" if extra.name == "overrides.txt" else "-r"
        command += [flag, str(extra)]
    _install(
        command, ", ".join(str(r.relative_to(paths.REPO)) for r in requirements), base
    )


def setup(base: Base) -> Path:
    """Create or reuse `base`'s managed environment; return its python."""
    ready = env_python(base, require=False)
    if ready is not None:
        return ready  # complete: nothing to write (the cache may be read-only)
    env = env_dir(base)
    python = env / "bin" / "python"
    with _locked(env):
        if not (env / COMPLETE).is_file():
            _check_disk(env.parent)
            print(
                f"setting up vLLM {base.version}'s environment in {env} "
                "(vllm and torch, ~9 GB; shared wheels come from uv's cache)",
                flush=True,
            )
            if not python.exists():
                subprocess.run(
                    [
                        str(uv_exe()),
                        "venv",
                        "--quiet",
                        "--python",
                        sys.executable,
                        str(env),
                    ],
                    check=True,
                )
            _uv_pip_install(python, _requirement_files(base), base)
            (env / COMPLETE).write_text(
                "".join(f.read_text(encoding="utf-8") for f in _requirement_files(base))
            )
        stamp = env / tools_stamp()
        if not stamp.is_file():
            print("installing the pinned test tools", flush=True)
            _uv_pip_install(python, [paths.REQUIREMENTS / "tools.txt"], base)
            stamp.write_text(
                (paths.REQUIREMENTS / "tools.txt").read_text(encoding="utf-8")
            )
    return python
