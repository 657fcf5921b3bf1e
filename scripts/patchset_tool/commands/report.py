# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset coverage` and `patchset capacity`: the meta-device reports,
run inside the base's vLLM interpreter against the chosen tree.

The tool takes `--base VERSION` and `--pristine`; every other option
passes through to the report untouched (no `--` needed)."""

import argparse
import importlib
import os

from .. import envmgr, runner
from .options import Subparsers, chosen_base, command_parser, flag

REPORTS = {
    "coverage": "which layers online quantization reaches",
    "capacity": "KV-cache tokens per budget, BF16 vs FP8",
}


def register(subparsers: Subparsers) -> None:
    for name, text in REPORTS.items():
        parser = command_parser(
            subparsers, name, run, help=text + " (on the meta device)", add_help=False
        )
        flag(parser, "--pristine", "report for the unpatched install")
        parser.add_argument("report_args", nargs=argparse.REMAINDER)
        parser.set_defaults(report=name)


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's own options, the report's options) of a report command:
    --base VERSION and --pristine are the tool's, the rest pass through."""
    own, rest = argv[:1], []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--pristine":
            own.append(arg)
        elif arg == "--base":
            own += [arg, next(args, "")]
        elif arg.startswith("--base="):
            own.append(arg)
        elif arg != "--":
            rest.append(arg)
    return own, rest


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The top `parser`'s reading of a report command line `argv`, with
    the report's own options in `report_args`."""
    own, rest = split_args(argv)
    args = parser.parse_args(own)
    args.report_args = rest
    return args


def run(args: argparse.Namespace) -> int:
    # The report's options are checked here, before any environment or
    # tree is made (help needs neither); its own process reads them again.
    reports = importlib.import_module("patchset_tool.reports.cli")
    if {"-h", "--help"} & set(args.report_args):
        reports.parse_report_args([args.report, "--help"])
    if reports.batch_arguments(args.report_args) is None:
        reports.parse_report_args([args.report, *args.report_args])
    base = chosen_base(args)
    envmgr.setup(base)
    # vLLM logs to stdout by default; keep stdout for the report alone,
    # so that `--json` output parses.
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    return runner.run(
        ["python", "-m", "patchset_tool.reports", args.report, *args.report_args],
        base,
        pristine=args.pristine,
        suite=True,
    )
