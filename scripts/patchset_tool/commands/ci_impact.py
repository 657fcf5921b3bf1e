# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset ci-impact`: which Buildkite steps a PR with the series triggers."""

import argparse

from .. import ci_impact
from .options import base_option, chosen_base


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ci-impact",
        help="which of the base's Buildkite steps a PR with the series "
        "triggers, and which of their tests `test` runs here",
    )
    base_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return ci_impact.run_in_env(chosen_base(args))
