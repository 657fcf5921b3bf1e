# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset env`: print a base's managed python."""

import argparse

from .. import envmgr
from .options import base_option, chosen_base


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("env", help="print a base's managed python")
    base_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(envmgr.env_python(chosen_base(args)))
    return 0
