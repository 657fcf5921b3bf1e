# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset test`: the whole test command (see testcmd.py)."""

import argparse
import os

from .. import testcmd
from ..bases import load_bases
from .options import base_option, chosen_base


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "test",
        help="the whole test command: check, tool tests, and per base the "
        "model tests on pristine and patched, lint and upstream's gates",
    )
    base_option(parser)
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="parts run side by side, and pytest-xdist workers of the tool's "
        "tests (default: the number of cores)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bases = [chosen_base(args)] if args.base else load_bases()
    return testcmd.run_tests(bases, jobs=args.jobs)
