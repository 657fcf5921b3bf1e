# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The exception types the tool raises (bad input, a stopping signal),
holding signals back while a step must not be cut, and the one line that
names a fault of the machine."""

import contextlib
import errno
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator


class PatchsetError(Exception):
    """A failure the user can act on; printed without a traceback.

    `exit_code` is what the process exits with (1 unless a subcommand has
    a documented code, such as 125 for `bisect-run`).
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program stands (as Ctrl-C raises
    KeyboardInterrupt) so that every clean-up on the way out runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


HELD: list[list[int]] = []
"""While `signals_held` runs: the signals it held back."""


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Run the body with SIGINT, SIGTERM and SIGHUP held back; one that
    came meanwhile is raised (`Terminated`) once the body is done. Off the
    main thread (the parts of `test`), where no signal is delivered, the
    body just runs."""
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread()
    old = {
        signum: signal.signal(signum, lambda signum, _: held.append(signum))
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        if main
    }
    HELD.append(held)
    try:
        yield
    finally:
        HELD.remove(held)
        for signum, handler in old.items():
            signal.signal(signum, handler)
    if held:
        raise Terminated(held[0])


DEBUG_VAR = "PATCHSET_DEBUG"
MESSAGE_LIMIT = 400
"""Characters of a fault's text that a message shows (a huge input is cut)."""


def shorten(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` on one line, cut to `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _no_space(exc: BaseException) -> str | None:
    """Where a write ran out of space, if `exc` (or, for a failed tree
    copy, any of its errors) is ENOSPC."""
    if isinstance(exc, shutil.Error) and exc.args and isinstance(exc.args[0], list):
        for _src, dst, why in exc.args[0]:
            if "No space left" in str(why):
                return str(dst)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return str(exc.filename or "")
    return None


def describe_fault(exc: BaseException) -> str:
    """One short line naming what failed and where."""
    if (where := _no_space(exc)) is not None:
        place = f" (writing {shorten(where, 200)})" if where else ""
        return f"no space left on the device{place}; free space and run again"
    if isinstance(exc, OSError) and exc.filename is not None:
        where = str(exc.filename)
        if exc.filename2 is not None:
            where = f"{where} -> {exc.filename2}"
        return shorten(f"{where}: {exc.strerror or exc}")
    if isinstance(exc, subprocess.CalledProcessError):
        command = exc.cmd if isinstance(exc.cmd, str) else " ".join(map(str, exc.cmd))
        return shorten(f"`{command}` exited {exc.returncode}")
    if isinstance(exc, subprocess.TimeoutExpired):
        command = exc.cmd if isinstance(exc.cmd, str) else " ".join(map(str, exc.cmd))
        return shorten(f"`{command}` did not finish in {exc.timeout:.0f} s")
    text = shorten(str(exc)) or type(exc).__name__
    return f"{text} ({type(exc).__name__}; {DEBUG_VAR}=1 shows the traceback)"
