# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset check`: the fast offline consistency check of every base."""

import argparse
import time

from .. import check
from .options import Subparsers, command_parser

HELP = "fast offline consistency check of every base's series"


def register(subparsers: Subparsers) -> None:
    command_parser(subparsers, "check", run, base=False, help=HELP)


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    for note in check.check():
        print(note)
    print(f"check passed in {time.monotonic() - start:.2f} s")
    return 0
