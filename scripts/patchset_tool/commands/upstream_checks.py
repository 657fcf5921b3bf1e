# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset upstream-checks`: upstream's own pre-commit checks over this repository."""

import argparse

from .. import upstream_checks
from .options import base_option, chosen_base, managed_python


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "upstream-checks",
        help="upstream's own check_test_tethering.py and check_spdx_header.py "
        "(from the base's release source) over this repository",
    )
    base_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    return upstream_checks.run_checks(base, managed_python(base))
