# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset build`: a pip-installable vLLM wheel with a base's series."""

import argparse

from .. import paths, wheel
from ..series import Series
from .options import Subparsers, chosen_base, command_parser, path_option

HELP = "a pip-installable vLLM wheel with the base's series, in dist/"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "build", run, help=HELP)
    parser.set_defaults(dist=paths.REPO / "dist")
    path_option(parser, "--dist", "default: dist/")


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    wheel.claim_dist(args.dist)  # before anything is fetched or written
    upstream = wheel.upstream_wheel(base.version)
    print(wheel.build_wheel(Series.load(base), upstream, args.dist))
    return 0
