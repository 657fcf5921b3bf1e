# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset verify-install`: what vLLM an environment holds.

For an operator: the installed vLLM version, which series (if any) the
wheel from `patchset build` put there (read from `vllm/glm5next_series.json`),
and whether every file still has the sha256 that the installed RECORD
lists. A file that differs, is missing, or sits in the package without a
RECORD entry has drifted (a hand edit, a partial reinstall); any drift
exits non-zero. vLLM is never imported: the environment's interpreter is
asked only for its site-packages.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from .bases import load_bases
from .distinfo import InstalledVllm, find_vllm, record_digest
from .errors import PatchsetError
from .series import SERIES_FILE, SHORT_ID_LENGTH, Series

PURELIB = 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
PURELIB_TIMEOUT = int(os.environ.get("PATCHSET_PYTHON_TIMEOUT", "60"))
"""Seconds an interpreter gets to name its site-packages."""


def installed_series(install: InstalledVllm) -> dict[str, Any] | None:
    """The series manifest a patched wheel installs, or None; raise, one
    line, when it is not the JSON object `build` writes."""
    manifest = install.site / SERIES_FILE
    if not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise PatchsetError(f"{manifest}: not valid JSON ({exc})") from exc
    base = data.get("base") if isinstance(data, dict) else None
    patches = data.get("patches") if isinstance(data, dict) else None
    if (
        not isinstance(base, dict)
        or not isinstance(patches, list)
        or not all(isinstance(p, dict) for p in patches)
    ):
        raise PatchsetError(
            f"{manifest}: not the series record `patchset build` writes (a JSON "
            "object with a base and a list of patches); the install was altered"
        )
    return data


def refuse_editable(install: InstalledVllm) -> None:
    """Raise, one line, for an install whose code RECORD does not list: an
    editable install (its code is a checkout's working tree) or one whose
    RECORD names no file of the vllm package; nothing could be verified."""
    direct_url = install.dist_info / "direct_url.json"
    try:
        url = json.loads(direct_url.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        url = {}
    if isinstance(url, dict) and (url.get("dir_info") or {}).get("editable"):
        raise PatchsetError(
            f"{install.dist_info}: an editable install of vLLM (from "
            f"{str(url.get('url', '?'))[:200]}); verify-install cannot verify it: "
            "its code is that checkout's working tree, which RECORD does not list"
        )
    if not any(rel.startswith("vllm/") for rel in install.record):
        raise PatchsetError(
            f"{install.dist_info}/RECORD lists no file of the vllm package; "
            "verify-install cannot verify this install"
        )


def purelib(python: Path) -> Path:
    """The site-packages directory of the environment `python` runs in."""
    try:
        proc = subprocess.run(
            [str(python), "-c", PURELIB],
            capture_output=True,
            text=True,
            timeout=PURELIB_TIMEOUT,
        )
    except OSError as exc:
        raise PatchsetError(f"cannot run {python}: {exc.strerror}") from exc
    except subprocess.TimeoutExpired as exc:
        raise PatchsetError(
            f"{python} did not name its site-packages within {PURELIB_TIMEOUT} s "
            "(a hanging interpreter or start-up hook); nothing was verified"
        ) from exc
    if proc.returncode or not proc.stdout.strip():
        raise PatchsetError(f"{python} did not name its site-packages:\n{proc.stderr}")
    return Path(proc.stdout.strip())


def drifted_files(install: InstalledVllm, outside: bool = True) -> list[str]:
    """One line per file that is not as RECORD says: its hash differs, it
    is missing, or it lies in the package without a RECORD entry (bytecode
    caches aside). Without `outside`, the files RECORD places outside the
    folder (scripts, in a `pip install --target` folder) are left out."""
    problems = []
    for rel, want in install.record.items():
        path = install.site / rel
        if not want or (not outside and rel.startswith("../")):
            continue
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif record_digest(path) != want:
            problems.append(f"{rel}: sha256 differs from RECORD")
    listed = {(install.site / rel).resolve() for rel in install.record}
    for path in sorted((install.site / "vllm").rglob("*")):
        cached = "__pycache__" in path.parts
        if path.is_file() and not cached and path.resolve() not in listed:
            rel = path.relative_to(install.site).as_posix()
            problems.append(f"{rel}: not listed in RECORD")
    return problems


def describe_series(series: dict[str, Any] | None, version: str) -> list[str]:
    """Report lines naming the installed series and its patches."""
    if series is None:
        return [f"series: none (upstream vLLM {version})"]
    base = series.get("base", {})
    lines = [
        (
            f"series: {series.get('series')} {series.get('short_id')} on vLLM "
            f"{base.get('version')} ({base.get('commit')}), "
            f"{len(series.get('patches', []))} patches:"
        )
    ]
    for patch in series.get("patches", []):
        lines.append(f"  {patch.get('name', '')[:4]} {patch.get('subject')}")
    lines.append(checkout_note(series))
    return lines


def checkout_note(series: dict[str, Any]) -> str:
    """Whether the installed series is this checkout's series for its base."""
    version = series.get("base", {}).get("version")
    base = next((b for b in load_bases() if b.version == version), None)
    if base is None or not base.series_file.is_file():
        return f"  (this checkout has no series for vLLM {version} to compare)"
    current = Series.load(base).id
    if current == series.get("id"):
        return f"  same series as this checkout's patches/{version}/"
    return (
        f"  differs from this checkout's patches/{version}/ (series "
        f"{current[:SHORT_ID_LENGTH]}): rebuild with "
        f"`scripts/patchset build --base {version}`"
    )


def verify_install(python: Path) -> int:
    """Print what vLLM the environment of `python` holds; raise naming the
    drifted files, if any. Returns 0 when every file matches RECORD."""
    site = purelib(python)
    print(f"python: {python}")
    return verify_site(site, outside=True)


def verify_site(site: Path, outside: bool = False) -> int:
    """`verify_install` for a folder vLLM is installed in: a site-packages
    or a `pip install --target` folder (`outside`: also the files RECORD
    places outside it, such as the scripts of an environment)."""
    install = find_vllm(site)
    refuse_editable(install)
    print(f"site-packages: {site}")
    print(f"vllm: {install.version} ({install.dist_info.name})")
    for line in describe_series(installed_series(install), install.version):
        print(line)
    drift = drifted_files(install, outside)
    hashed = sum(
        1
        for rel, want in install.record.items()
        if want and (outside or not rel.startswith("../"))
    )
    if drift:
        raise PatchsetError(
            f"{len(drift)} of the installed vLLM's files drifted from "
            f"{install.dist_info.name}/RECORD:\n  "
            + "\n  ".join(drift)
            + "\nReinstall the same wheel (uv pip install --no-deps --reinstall "
            "WHEEL) or go back to upstream (uv pip install --no-deps "
            f"--reinstall vllm=={install.version.split('+')[0]})"
        )
    print(f"files: all {hashed} match RECORD")
    if caches := sum(1 for p in (install.site / "vllm").rglob("__pycache__/*")):
        print(
            f"bytecode: {caches} file(s) under __pycache__ not checked (RECORD "
            "lists none; Python recompiles one whose source's size or mtime "
            "changed, and `find vllm -name __pycache__ -exec rm -r {} +` removes "
            "them)"
        )
    return 0


def default_python() -> Path:
    """`python3` on PATH: the environment an operator has activated."""
    found = shutil.which("python3")
    return Path(found) if found else Path(sys.executable)
