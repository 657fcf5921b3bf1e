# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command line of `scripts/patchset`: the top parser, and dispatch to the
subcommands (each in its own module under `commands/`)."""

import argparse
import os
import subprocess
import sys
import zipfile

from .commands import COMMANDS, report
from .errors import PatchsetError

START_HERE = """\
where to start:
  scripts/patchset setup                 the managed environment (once)
  scripts/patchset apply                 the patched tree in build/<version>/
  scripts/patchset run -- pytest ...     a command against that tree
  scripts/patchset worktree              a git work tree to edit the series;
  scripts/patchset refresh N             then write patch N back from it
  scripts/patchset test                  everything, before sending
Each subcommand has its own --help."""


def build_parser() -> argparse.ArgumentParser:
    """The top parser, with every command's own parser under it."""
    parser = argparse.ArgumentParser(
        prog="patchset",
        description="Apply, verify and test the GLM-5.3-Flash series against "
        "the vLLM releases declared in bases.toml.",
        epilog=START_HERE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    subparsers = parser.add_subparsers(dest="subcommand", required=True)
    for command in COMMANDS:
        command.register(subparsers)
    return parser


EXPECTED_FAULTS = (
    OSError,
    ValueError,
    subprocess.CalledProcessError,
    zipfile.BadZipFile,
)
"""Faults of the machine or of a file (missing, unreadable, read-only,
disk full, not JSON, a failed helper process): one line, not a traceback."""
DEBUG_VAR = "PATCHSET_DEBUG"


def describe_fault(exc: BaseException) -> str:
    """One line naming what failed and where."""
    if isinstance(exc, OSError) and exc.filename is not None:
        where = exc.filename
        if exc.filename2 is not None:
            where = f"{where} -> {exc.filename2}"
        return f"{where}: {exc.strerror or exc}"
    if isinstance(exc, subprocess.CalledProcessError):
        command = exc.cmd if isinstance(exc.cmd, str) else " ".join(map(str, exc.cmd))
        return f"`{command}` exited {exc.returncode}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{text} ({type(exc).__name__}; {DEBUG_VAR}=1 shows the traceback)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] and argv[0] in report.REPORTS:
        # The report's own options pass through untouched (no `--` needed).
        args = report.parse_args(parser, argv)
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except PatchsetError as exc:
        print(f"patchset: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except EXPECTED_FAULTS as exc:
        if os.environ.get(DEBUG_VAR):
            raise
        print(f"patchset: error: {describe_fault(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "patchset: interrupted; nothing partial was left in place", file=sys.stderr
        )
        return 130
