# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command line of `scripts/patchset`: the top parser, and dispatch to the
subcommands (each in its own module under `commands/`)."""

import argparse
import csv
import os
import signal
import subprocess
import sys
import tempfile
import zipfile
from types import FrameType

from . import gitutil
from .commands import COMMANDS, options, report
from .errors import DEBUG_VAR, PatchsetError, Terminated, describe_fault, shorten

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
    csv.Error,
    EOFError,
    subprocess.CalledProcessError,
    subprocess.TimeoutExpired,
    zipfile.BadZipFile,
)
"""Faults of the machine or of a file (missing, unreadable, read-only,
disk full, not JSON, truncated, a failed or hanging helper process): one
line, not a traceback."""
LINE_LIMIT = 1000
"""Characters of each line of an error message (an echoed input is cut)."""


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`argv` read by `parser`; an option the command does not know is
    answered with that command's usage, not the top-level one."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = options.PARSERS.get(args.subcommand, parser)
        command.error(f"unrecognized arguments: {shorten(' '.join(extra), 200)}")
    return args


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


def stop_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into an exception where the program stands,
    as Ctrl-C is, so that every clean-up on the way out runs."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)


def exit_status(code: int) -> int:
    """A child's status as a shell gives it: 128+N for one killed by signal N."""
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    stop_on_signals()
    if (tmp := os.environ.get("TMPDIR")) and not os.path.isabs(tmp):
        os.environ["TMPDIR"] = os.path.abspath(tmp)  # git runs in other folders
        tempfile.tempdir = None
    try:
        parser = build_parser()
        if argv[:1] and argv[0] in report.REPORTS:
            # The report's own options pass through untouched (no `--` needed).
            args = report.parse_args(parser, argv)
        else:
            args = parse_args(parser, argv)
        return exit_status(int(args.func(args)))
    except PatchsetError as exc:
        lines = str(exc).splitlines() or [""]
        text = "\n".join(shorten(line, LINE_LIMIT) for line in lines)
        print(f"patchset: error: {text}", file=sys.stderr)
        return exc.exit_code
    except EXPECTED_FAULTS as exc:
        if os.environ.get(DEBUG_VAR):
            raise
        print(f"patchset: error: {describe_fault(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        name = signal.Signals(signum).name
        left = "nothing partial was left in place"
        if gitutil.PUBLISHED:
            left = f"after it had put {' and '.join(gitutil.PUBLISHED)} in place"
        print(f"patchset: interrupted ({name}); {left}", file=sys.stderr)
        return 128 + signum
