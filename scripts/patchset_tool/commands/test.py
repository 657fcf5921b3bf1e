# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset test`: the whole test command (see testcmd.py)."""

import argparse
import os

from .. import testcmd
from ..bases import load_bases
from .options import Subparsers, chosen_base, command_parser, positive_int

HELP = "the whole test command: check, tool tests, model tests, lint, upstream gates"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(
        subparsers, "test", run, base_default="every declared base", help=HELP
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="parts run side by side, and pytest-xdist workers of the tool's "
        "tests (default: the number of cores)",
    )


def run(args: argparse.Namespace) -> int:
    bases = [chosen_base(args)] if args.base else load_bases()
    return testcmd.run_tests(bases, jobs=args.jobs)
