# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset verify-install`: which vLLM and series an environment holds."""

import argparse
from pathlib import Path

from .. import installed
from .options import Subparsers, command_parser

HELP = "which vLLM and series an environment holds; exit 1 if a file left RECORD"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "verify-install", run, base=False, help=HELP)
    parser.add_argument(
        "python",
        nargs="?",
        type=Path,
        metavar="PYTHON|DIR",
        help="the environment's interpreter (default: python3 on PATH), or "
        "the folder of a `pip install --target DIR`",
    )


def run(args: argparse.Namespace) -> int:
    if args.python is not None and args.python.is_dir():
        return installed.verify_site(args.python)  # `pip install --target DIR`
    return installed.verify_install(args.python or installed.default_python())
