# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset upstream-checks`: upstream's own pre-commit checks over this repository."""

import argparse

from .. import upstream_checks
from .options import Subparsers, chosen_base, command_parser, managed_python

HELP = (
    "upstream's own check_test_tethering.py and check_spdx_header.py "
    "(from the base's release source) over this repository"
)


def register(subparsers: Subparsers) -> None:
    command_parser(subparsers, "upstream-checks", run, help=HELP)


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    return upstream_checks.run_checks(base, managed_python(base))
