# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset bisect-run`: the script for `git bisect run`."""

import argparse

from .. import bisect
from ..series import Series
from .options import Subparsers, chosen_base, command_parser, path_option

HELP = "for `git bisect run`: 125 if the series does not apply, else the tests' verdict"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "bisect-run", run, help=HELP)
    path_option(
        parser, "--vllm-src", "the vLLM checkout `git bisect` moves", required=True
    )
    parser.add_argument(
        "pytest_args",
        nargs="*",
        metavar="PYTEST_ARG",
        help="passed to pytest after the series' test files",
    )


def run(args: argparse.Namespace) -> int:
    series = Series.load(chosen_base(args))
    return bisect.bisect_run(series, args.vllm_src, args.pytest_args)
