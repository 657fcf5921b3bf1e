# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset build`: a pip-installable vLLM wheel with a base's series."""

import argparse
from pathlib import Path

from .. import paths, trees, wheel
from ..series import Series
from .options import base_option, chosen_base


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "build",
        help="a pip-installable vLLM wheel with the base's series, in dist/",
    )
    base_option(parser)
    parser.add_argument("--dist", type=Path, metavar="DIR", help="default: dist/")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    dist = args.dist or paths.REPO / "dist"
    trees.refuse_install(dist, "--dist")
    upstream = wheel.upstream_wheel(base.version)
    print(wheel.build_wheel(Series.load(base), upstream, dist))
    return 0
