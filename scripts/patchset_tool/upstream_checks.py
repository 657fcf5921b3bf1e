# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Upstream's own pre-commit checks, run over this repository.

vLLM's `check_test_tethering.py` and `check_spdx_header.py` are taken from the
primary base's release source, not reimplemented, and run in a scratch git
repository that holds this repository as upstream would: the base's
`.buildkite/` with `ci/test_areas/` laid over, `tests/` with every base's model
tests laid over, and `ci/test_tethering_allowlist.txt` as upstream's allowlist.
The SPDX script runs on copies (it edits in place); an extension-less script
gets a `.py` suffix, since upstream's script tells the comment style by it.
"""

import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import TextIO

from . import gitutil, paths, upstream
from .bases import Base, load_bases
from .series import Series

TETHERING = "tools/pre_commit/check_test_tethering.py"
SPDX = "tools/pre_commit/check_spdx_header.py"
ALLOWLIST = Path("ci/test_tethering_allowlist.txt")
SPDX_DIRS = ("vllm_overlay", "tests", "scripts")


def upstream_script(base: Base, script: str) -> str:
    """The text of `script` in `base`'s release source."""
    history = upstream.release_history()
    return gitutil.git("show", f"{base.tag}:{script}", cwd=history).stdout


def _extract_upstream(base: Base, folder: str, dest: Path) -> None:
    """Write `folder` of `base`'s release source under `dest`."""
    history = upstream.release_history()
    with tempfile.TemporaryDirectory(prefix="patchset-archive-") as tmp:
        archive = Path(tmp) / "folder.tar"
        gitutil.git("archive", f"--output={archive}", base.tag, folder, cwd=history)
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")


def _copy_tree(src: Path, dest: Path) -> None:
    for path in paths.files_under(src):
        target = dest / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def tethering_tree(dest: Path, base: Base, repo: Path, test_roots: list[Path]) -> Path:
    """Lay out `repo`'s CI steps, allowlist and the tests under
    `test_roots` (each the parent of a `tests/`-relative tree) as upstream's
    checkout under `dest`, with `base`'s own Buildkite steps and tethering
    script; return `dest`."""
    _extract_upstream(base, ".buildkite", dest)
    _copy_tree(repo / "ci" / "test_areas", dest / ".buildkite" / "test_areas")
    for root in test_roots:
        _copy_tree(root, dest / "tests")
    tools = dest / "tools" / "pre_commit"
    tools.mkdir(parents=True)
    (tools / Path(TETHERING).name).write_text(upstream_script(base, TETHERING))
    allowlist = repo / ALLOWLIST
    if allowlist.is_file():
        shutil.copyfile(allowlist, tools / "test_tethering_allowlist.txt")
    gitutil.git("init", "--quiet", cwd=dest)
    gitutil.git("add", "--all", cwd=dest)
    return dest


def check_tethering(
    base: Base, python: Path, repo: Path, test_roots: list[Path]
) -> tuple[bool, str]:
    """Upstream's tethering check, full scan (`--all`), over `repo`'s CI
    steps and the tests under `test_roots`: (passed, its output)."""
    with tempfile.TemporaryDirectory(prefix="patchset-tethering-") as tmp:
        tree = tethering_tree(Path(tmp), base, repo, test_roots)
        done = subprocess.run(
            [str(python), TETHERING, "--all"],
            cwd=tree,
            capture_output=True,
            text=True,
        )
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def spdx_files(repo: Path) -> list[Path]:
    """The Python files of `repo` that carry vLLM's SPDX header: under
    vllm_overlay/, tests/ and scripts/, and the extension-less scripts."""
    found = [
        p for d in SPDX_DIRS for p in paths.files_under(repo / d) if p.suffix == ".py"
    ]
    for script in sorted((repo / "scripts").glob("*")):
        if script.is_file() and not script.suffix:
            first_line = script.read_bytes().split(b"\n", 1)[0]
            if first_line.startswith(b"#!") and b"python" in first_line:
                found.append(script)
    return found


def check_spdx(
    base: Base, python: Path, repo: Path, files: list[Path]
) -> tuple[bool, str]:
    """Upstream's SPDX check over copies of `files` (inside `repo`):
    (passed, its output, naming the files by their path in `repo`)."""
    with tempfile.TemporaryDirectory(prefix="patchset-spdx-") as tmp:
        script = Path(tmp) / Path(SPDX).name
        script.write_text(upstream_script(base, SPDX))
        copies = []
        for path in files:
            rel = path.resolve().relative_to(repo.resolve()).as_posix()
            copy = Path(tmp) / "repo" / (rel if path.suffix else rel + ".py")
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
            copies.append(copy.relative_to(tmp).as_posix())
        done = subprocess.run(
            [str(python), script.name, *copies],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
    output = (done.stdout + done.stderr).replace("repo/", "").strip()
    summary = f"upstream's check_spdx_header.py over {len(files)} files"
    return done.returncode == 0, f"{output}\n{summary}".strip()


def run_checks(
    base: Base, python: Path, repo: Path = paths.REPO, out: TextIO | None = None
) -> int:
    """Both checks over this repository (every base's model tests); print
    their output to `out` (default: stdout); 0 only if both pass."""
    roots = [
        b.overlay / "tests" for b in load_bases() if (b.overlay / "tests").is_dir()
    ]
    results = {
        "check_test_tethering.py --all": check_tethering(
            base, python, repo, [repo / "tests", *roots]
        ),
        "check_spdx_header.py": check_spdx(base, python, repo, spdx_files(repo)),
    }
    for name, (ok, output) in results.items():
        state = "ok" if ok else "FAILED"
        print(f"== upstream {name} (vLLM {base.version}): {state}", file=out)
        if output:
            print(output, file=out)
    return 0 if all(ok for ok, _ in results.values()) else 1


def tether_new_tests(
    series: Series, src: Path, python: Path, out: TextIO | None = None
) -> int:
    """Run the checkout `src`'s own test-tethering hook with `python` on
    the test files `series` adds, when the checkout has one; say what it
    found on `out` (default: stdout, as the hook's own output); its exit
    status (0 when not run)."""
    script = src / TETHERING
    added = sorted(
        p for p in series.created if p.startswith("tests/") and p.endswith(".py")
    )
    if not script.is_file() or not added:
        print(f"{src} has no {TETHERING}; upstream tethering not run", file=out)
        return 0
    if out is not None:
        out.flush()
    rc = subprocess.run(
        [str(python), str(script), *added], cwd=src, stdout=out, stderr=out
    ).returncode
    status = "passes" if rc == 0 else f"FAILS (exit {rc})"
    print(
        f"upstream check_test_tethering.py on {len(added)} new test files: {status}",
        file=out,
    )
    return rc
