# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset upstream-checks`: upstream's own pre-commit checks over this repository."""

import argparse

from .. import envmgr, upstream_checks
from .options import Subparsers, chosen_base, command_parser

HELP = "upstream's check_test_tethering.py and check_spdx_header.py on this repo"


def register(subparsers: Subparsers) -> None:
    command_parser(subparsers, "upstream-checks", run, help=HELP)


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    return upstream_checks.run_checks(base, envmgr.setup(base))
