# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset env`: print a base's managed python."""

import argparse

from .. import envmgr
from .options import Subparsers, chosen_base, command_parser

HELP = "print a base's managed python"


def register(subparsers: Subparsers) -> None:
    command_parser(subparsers, "env", run, help=HELP)


def run(args: argparse.Namespace) -> int:
    print(envmgr.env_python(chosen_base(args)))
    return 0
