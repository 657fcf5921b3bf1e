# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The command line shared by the meta-device reports (coverage, capacity).

A report prints its result as text or, with `--json`, as one JSON line.
With `--batch FILE` (a JSON list of argument lists) one process prints one
JSON line per argument list: vLLM is imported once, not once per report. A
list that begins with the name of a report (`coverage`, `capacity`) is that
report's arguments, so one process can run both (`capacity` mocks the CUDA
platform only while it measures, and restores it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Measure = Callable[[argparse.Namespace], dict[str, Any]]
Format = Callable[[dict[str, Any], float], str]
Parse = Callable[[list[str] | None], argparse.Namespace]
REPORTS = ("coverage", "capacity")


def report_functions(name: str) -> tuple[Parse, Measure]:
    """The argument parser and measurement of report `name`."""
    module = importlib.import_module(f"patchset_tool.{name}")
    return module.parse_args, module.measure


def batch_arguments(argv: list[str]) -> list[list[str]] | None:
    """The argument lists of `--batch FILE` in `argv`, or None without it."""
    if "--batch" not in argv:
        return None
    where = argv.index("--batch")
    if where + 1 >= len(argv) or len(argv) != 2:
        sys.exit("--batch FILE takes no other option (put them in FILE)")
    try:
        cases = json.loads(Path(argv[where + 1]).read_text())
    except OSError as exc:
        sys.exit(f"patchset: error: --batch {argv[where + 1]}: {exc.strerror}")
    except ValueError as exc:
        sys.exit(f"patchset: error: --batch {argv[where + 1]}: not JSON ({exc})")
    if not isinstance(cases, list) or not all(isinstance(c, list) for c in cases):
        sys.exit(f"{argv[where + 1]}: expected a JSON list of argument lists")
    return [[str(arg) for arg in case] for case in cases]


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


def run_reports(
    argv: list[str] | None, parse: Parse, measure: Measure, text: Format
) -> int:
    """Print one report for `argv`, or one JSON line per `--batch` case."""
    argv = sys.argv[1:] if argv is None else argv
    cases = batch_arguments(argv)
    for case in cases if cases is not None else [argv]:
        parse_case, measure_case = parse, measure
        if cases is not None and case[:1] and case[0] in REPORTS:
            parse_case, measure_case = report_functions(case[0])
            case = case[1:]
        args = parse_case(case)
        start = time.monotonic()
        report = measure_case(args)
        seconds = time.monotonic() - start
        if args.json or cases is not None:
            print(json.dumps({**report, "seconds": round(seconds, 1)}), flush=True)
        else:
            print(text(report, seconds))
    return 0


def exit_without_teardown(code: int) -> None:
    """Exit with `code` once the output is flushed, skipping the
    interpreter's teardown of torch and vLLM (seconds of C++ destructors
    that have nothing left to do)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
