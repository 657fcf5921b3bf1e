# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset bisect-run`: the script for `git bisect run`.

Only a test verdict exits 0 (good) or 1 (bad). Whatever the tool cannot
judge at a commit exits 125 (`git bisect` skips it); whatever it cannot
judge at any commit (a bad option or path, a dirty checkout, a failed
set-up, a tool error, an interrupt) exits 255 (or 128+N for signal N),
which aborts the bisect instead of naming a wrong first bad commit.
"""

import argparse
import os
import sys
from typing import NoReturn

from .. import bisect
from ..errors import PatchsetError
from ..series import Series
from .options import Subparsers, chosen_base, command_parser, path_option

HELP = "for `git bisect run`: 0 good, 1 bad; 125 skip; 255 aborts the bisect"
DESCRIPTION = (
    "Apply the series at HEAD of the checkout (in a scratch clone) and run "
    "its tests there. Exit codes, as `git bisect run` reads them: 0 the tests "
    "pass, 1 they fail (the only verdicts); 125 this commit cannot be judged "
    "(the series does not apply, vLLM does not import, no declared release "
    "precedes it, pytest ran no test: an error, all skipped, none selected): "
    "skip it; 255 (or 128+N "
    "after signal N, 130 after Ctrl-C) nothing can be judged (a mistyped "
    "option or path, a dirty checkout or one in the middle of another git "
    "operation, a failed environment set-up, a tool error): the bisect stops."
)


def register(subparsers: Subparsers) -> None:
    parser = command_parser(
        subparsers, "bisect-run", run, help=HELP, description=DESCRIPTION
    )
    path_option(
        parser, "--vllm-src", "the vLLM checkout `git bisect` moves", required=True
    )
    parser.add_argument(
        "pytest_args",
        nargs="*",
        metavar="PYTEST_ARG",
        help="passed to pytest after the series' test files",
    )
    _abort_on_usage_errors(parser)


def _abort_on_usage_errors(parser: argparse.ArgumentParser) -> None:
    """A usage error (argparse exits 2, which `git bisect run` reads as
    "bad") aborts the bisect instead; an unknown option is one too."""

    def error(message: str) -> NoReturn:
        parser.print_usage(sys.stderr)
        parser.exit(bisect.ABORT, f"{parser.prog}: error: {message}\n")

    def parse_known_args(
        args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = argparse.ArgumentParser.parse_known_args(
            parser, args, namespace
        )
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, []

    parser.error = error  # type: ignore[method-assign]
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign, assignment]


def run(args: argparse.Namespace) -> int:
    try:
        series = Series.load(chosen_base(args))
        return bisect.bisect_run(series, args.vllm_src, args.pytest_args)
    except PatchsetError as exc:
        print(f"patchset: error: {exc}", file=sys.stderr)
        return bisect.abort(str(exc).splitlines()[0])
    except KeyboardInterrupt:
        return bisect.abort("interrupted", bisect.INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 (no exception may read as bad)
        if os.environ.get("PATCHSET_DEBUG"):
            raise
        return bisect.abort(f"{type(exc).__name__}: {' '.join(str(exc).split())}")
