# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.33.0's own source tree, from its sdist on PyPI, as a git checkout.

The wheel lacks `tests/`, `tools/` and `.buildkite/`; the sdist has them.
Made once per machine in the shared cache, it lets the test command prove
that the series `git am -3`s onto the real tree and passes upstream's own
pre-commit gates (test tethering, SPDX headers) there.
"""

import hashlib
import json
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from . import gitutil, paths
from .errors import PatchsetError

SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
IDENTITY = ["-c", "user.name=patchset", "-c", "user.email=patchset@localhost"]


def source_checkout() -> Path:
    """The cached git checkout of the 0.33.0 sdist (tag v0.33.0)."""
    dest = paths.cache_root() / "src" / f"vllm-{paths.VLLM_VERSION}"
    if (dest / ".git").is_dir():
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        archive = _download_sdist(Path(tmp))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        staging = dest.with_name(dest.name + ".staging")
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(tmp) / f"vllm-{paths.VLLM_VERSION}"), staging)
    gitutil.git("init", "--quiet", cwd=staging)
    # --force: the sdist ships files its .gitignore names (vllm/_version.py)
    gitutil.git("add", "--all", "--force", cwd=staging)
    gitutil.git(
        *IDENTITY,
        "commit",
        "--quiet",
        "-m",
        f"vLLM {paths.VLLM_VERSION} sdist",
        cwd=staging,
    )
    gitutil.git("tag", f"v{paths.VLLM_VERSION}", cwd=staging)
    staging.rename(dest)
    return dest


def _download_sdist(into: Path) -> Path:
    """Download the sdist from PyPI and check it against PyPI's sha256."""
    print(f"fetching the vllm=={paths.VLLM_VERSION} sdist from PyPI", flush=True)
    name = f"vllm-{paths.VLLM_VERSION}.tar.gz"
    request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": SIMPLE_JSON})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        sdist = next(f for f in files if f["filename"] == name)
        archive = into / name
        with urllib.request.urlopen(sdist["url"], timeout=600) as response:
            archive.write_bytes(response.read())
    except (OSError, StopIteration, KeyError, ValueError) as exc:
        raise PatchsetError(f"could not download {name} from PyPI: {exc}") from exc
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != sdist["hashes"]["sha256"]:
        raise PatchsetError(f"{archive.name}: sha256 {digest} is not PyPI's")
    return archive


def scratch_clone(into: Path) -> Path:
    """A throw-away clone of the cached checkout under `into`."""
    clone = into / "vllm"
    gitutil.git(
        "clone", "--quiet", "--shared", str(source_checkout()), str(clone), cwd=into
    )
    return clone
