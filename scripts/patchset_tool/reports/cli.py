# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The command line of the meta-device reports (coverage, capacity): one
argument parser, with a subcommand per report.

    python -m patchset_tool.reports NAME [options] [--json]
    python -m patchset_tool.reports NAME --batch FILE

A report prints its result as text or, with `--json`, as one JSON line.
With `--batch FILE` (a JSON list of argument lists) one process prints one
JSON line per argument list: vLLM is imported once, not once per report. A
list that begins with the name of a report (`coverage`, `capacity`) is that
report's arguments, any other NAME's, so one process can run both
(`capacity` mocks the CUDA platform only while it measures, and restores it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from . import capacity, coverage


class Report(Protocol):
    """What a report module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def measure(self, args: argparse.Namespace) -> dict[str, Any]: ...

    def format_report(self, report: dict[str, Any], seconds: float) -> str: ...


REPORTS: dict[str, Report] = {"coverage": coverage, "capacity": capacity}


def batch_arguments(argv: list[str]) -> list[list[str]] | None:
    """The argument lists of `--batch FILE` in `argv`, or None without it."""
    if "--batch" not in argv:
        return None
    where = argv.index("--batch")
    if where + 1 >= len(argv) or len(argv) != 2:
        sys.exit("--batch FILE takes no other option (put them in FILE)")
    try:
        cases = json.loads(Path(argv[where + 1]).read_text(encoding="utf-8"))
    except OSError as exc:
        sys.exit(f"patchset: error: --batch {argv[where + 1]}: {exc.strerror}")
    except ValueError as exc:
        sys.exit(f"patchset: error: --batch {argv[where + 1]}: not JSON ({exc})")
    if not isinstance(cases, list) or not all(isinstance(c, list) for c in cases):
        sys.exit(f"{argv[where + 1]}: expected a JSON list of argument lists")
    cases = [[str(arg) for arg in case] for case in cases]
    for number, case in enumerate(cases, 1):
        if own := [a for a in case if a.split("=")[0] in ("--base", "--pristine")]:
            sys.exit(
                f"patchset: error: --batch {argv[where + 1]}: case {number} gives "
                f"{own[0][:40]}, which is for the whole batch: put it before "
                "--batch (every case runs on one tree)"
            )
    return cases


def add_tool_options(parser: argparse.ArgumentParser) -> None:
    """Document the options `scripts/patchset` takes for every report (it
    handles them itself; they never reach the report's own parser)."""
    tool = parser.add_argument_group("options of scripts/patchset")
    tool.add_argument(
        "--base",
        metavar="VERSION",
        help="the vLLM release (see bases.toml; default: the primary base)",
    )
    tool.add_argument(
        "--pristine", action="store_true", help="report for the unpatched install"
    )
    tool.add_argument(
        "--batch",
        metavar="FILE",
        help="a JSON list of argument lists: one JSON line per list, from one "
        "process (takes no other option)",
    )


def build_parser(reports: Mapping[str, Report] = REPORTS) -> argparse.ArgumentParser:
    """The one parser of every report: `NAME [options]`."""
    parser = argparse.ArgumentParser(
        prog="python -m patchset_tool.reports", description=__doc__
    )
    sub = parser.add_subparsers(dest="report", required=True, metavar="NAME")
    for name, report in reports.items():
        p = sub.add_parser(name, prog=f"patchset {name}", description=report.__doc__)
        report.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print JSON")
        add_tool_options(p)
    return parser


def parse_report_args(
    argv: list[str], reports: Mapping[str, Report] = REPORTS
) -> argparse.Namespace:
    """The options of `NAME [options]`; `.report` is NAME."""
    return build_parser(reports).parse_args(argv)


def main(argv: list[str] | None = None, reports: Mapping[str, Report] = REPORTS) -> int:
    """Print one report for `NAME [options]`, or one JSON line per case of
    `NAME --batch FILE`."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(reports)
    cases = batch_arguments(argv[1:]) if argv[:1] and argv[0] in reports else None
    if cases is not None:
        cases = [c if c[:1] and c[0] in reports else [argv[0], *c] for c in cases]
    for case in cases if cases is not None else [argv]:
        args = parser.parse_args(case)
        report = reports[args.report]
        start = time.monotonic()
        try:
            result = report.measure(args)
        except (ValueError, TypeError, OverflowError) as exc:  # vLLM's checks
            why = " ".join(str(exc).split())[:300]
            print(f"patchset {args.report}: error: {why}", file=sys.stderr)
            return 2
        seconds = time.monotonic() - start
        if args.json or cases is not None:
            print(json.dumps({**result, "seconds": round(seconds, 1)}), flush=True)
        else:
            print(report.format_report(result, seconds))
    return 0


def exit_without_teardown(code: int) -> None:
    """Exit with `code` once the output is flushed, skipping the
    interpreter's teardown of torch and vLLM (seconds of C++ destructors
    that have nothing left to do)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
