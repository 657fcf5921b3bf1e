# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset check`: the fast offline consistency check of every base."""

import argparse
import time

from .. import check


def register(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser(
        "check", help="fast offline consistency check of every base's series"
    ).set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    for note in check.check():
        print(note)
    print(f"check passed in {time.monotonic() - start:.2f} s")
    return 0
