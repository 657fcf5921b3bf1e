# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`bisect-run`: the script for `git bisect run` against vLLM main.

Exit codes follow git bisect: only a test verdict is 0 (good) or 1 (bad);
125 skips a commit that cannot be judged (the series does not apply, vLLM
cannot be imported there, no declared release precedes it, pytest ran no
test: an error, all skipped, none selected); ABORT (255), or 128+N after
signal N, stops the bisect when nothing can be judged (bad input, a dirty
checkout, a failed set-up, a tool error, an interrupt). The checkout's
Python runs over the compiled extensions of the release it belongs to (the
newest declared base not newer than the commit), linked into a scratch
clone as with vLLM's precompiled wheels, so this bisects Python changes,
which is what the series touches.
"""

import subprocess
import sys
from pathlib import Path

from . import envmgr, gitutil, junit, sourcetree
from .distinfo import default_install
from .errors import PatchsetError
from .series import Series

SKIP = 125
ABORT = 255
"""`git bisect run` stops the bisect on an exit code from 128 to 255."""
INTERRUPTED = 130


def abort(why: str, code: int = ABORT) -> int:
    """Say that the bisect must stop, and return `code` (>= 128)."""
    print(
        f"bisect-run: {why}; nothing can be judged, so this aborts the bisect ({code})",
        file=sys.stderr,
    )
    return code


def verdict(pytest_rc: int) -> int:
    """What `git bisect run` is told for pytest's exit code: 0 and 1 are
    verdicts (all passed; some failed); a usage error (4) would recur at
    every commit and a signal is an interrupt, so both abort; anything else
    (interrupted or collection errors (2), an internal error (3), no tests
    (5)) is a commit that cannot be judged: skip it."""
    if pytest_rc in (0, 1):
        return pytest_rc
    if pytest_rc == 4:
        return ABORT
    if pytest_rc < 0:
        return 128 - pytest_rc
    return SKIP


def bisect_run(series: Series, src: Path, pytest_args: list[str]) -> int:
    """Apply `series` at HEAD of `src` in a scratch clone and run its
    model tests there, over the compiled extensions of the release HEAD
    belongs to; return 0, 1 or 125."""
    head = gitutil.require_clean_checkout(src, allow_bisect=True)[:12]
    release = gitutil.release_of(src)
    if release is None:
        print(f"bisect-run: {head}: no declared release precedes it, skipping (125)")
        return SKIP
    python = envmgr.env_python(release, require=False) or envmgr.setup(release)
    with gitutil.scratch_clone(src) as scratch:
        try:
            gitutil.am_series(scratch, series.patches)
        except PatchsetError as exc:
            print(f"bisect-run: {head}: series does not apply, skipping (125)\n{exc}")
            return SKIP
        install = default_install(release)
        sourcetree.link_extensions(install.package, scratch)
        env = sourcetree.checkout_env(python, release, scratch)
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
                f"{release.version} extensions, skipping (125)\n"
                f"{probe.stderr[-2000:]}"
            )
            return SKIP
        # The test files the series adds, run as upstream CI runs them:
        # from tests/, with upstream's tests/conftest.py loaded, and with
        # what this CPU host lacks that a GPU runner has (the suite's plugin).
        tests = [
            str(Path(t).relative_to("tests"))
            for t in series.test_files
            if Path(t).name.startswith("test_")
        ]
        xml = scratch / ".patchset-junit.xml"
        command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        command += sourcetree.cpu_host_plugin(env)
        command += [f"--junitxml={xml}", *tests, *pytest_args]
        result = subprocess.run(command, cwd=scratch / "tests", env=env).returncode
        ran = xml.is_file() and "passed" in junit.read_outcomes(xml).values()
    if result == 0 and not ran:
        print(f"bisect-run: {head}: no selected test ran (all skipped), skipping (125)")
        return SKIP
    told = verdict(result)
    print(f"bisect-run: {head}: pytest exited {result}; reporting {told}")
    return told
