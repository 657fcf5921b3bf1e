# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset setup`: create or reuse a base's managed environment."""

import argparse
import time

from .. import envmgr
from ..bases import load_bases
from .options import Subparsers, chosen_base, command_parser, flag

HELP = "create or reuse a base's managed environment"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "setup", run, help=HELP)
    flag(parser, "--all", "every declared base")


def run(args: argparse.Namespace) -> int:
    for base in load_bases() if args.all else [chosen_base(args)]:
        start = time.monotonic()
        python = envmgr.setup(base)
        print(
            f"vLLM {base.version} environment ready: {python} "
            f"({time.monotonic() - start:.1f} s)"
        )
    return 0
