# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset setup`: create or reuse a base's managed environment."""

import argparse
import time

from .. import envmgr
from ..bases import load_bases
from .options import base_option, chosen_base


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "setup", help="create or reuse a base's managed environment"
    )
    base_option(parser)
    parser.add_argument("--all", action="store_true", help="every declared base")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for base in load_bases() if args.all else [chosen_base(args)]:
        start = time.monotonic()
        python = envmgr.setup(base)
        print(
            f"vLLM {base.version} environment ready: {python} "
            f"({time.monotonic() - start:.1f} s)"
        )
    return 0
