# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset verify-install`: which vLLM and series an environment holds."""

import argparse
from pathlib import Path

from .. import installed


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify-install",
        help="which vLLM and series an environment holds, and whether its "
        "files still match RECORD (exit 1 on drift)",
    )
    parser.add_argument(
        "python",
        nargs="?",
        type=Path,
        metavar="PYTHON|DIR",
        help="the environment's interpreter (default: python3 on PATH), or "
        "the folder of a `pip install --target DIR`",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.python is not None and args.python.is_dir():
        return installed.verify_site(args.python)  # `pip install --target DIR`
    return installed.verify_install(args.python or installed.default_python())
