# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset ci-impact`: which Buildkite steps a PR with the series triggers."""

import argparse

from .. import ci_impact
from .options import Subparsers, chosen_base, command_parser

HELP = "which Buildkite steps a PR with the series triggers, and what `test` runs here"


def register(subparsers: Subparsers) -> None:
    command_parser(subparsers, "ci-impact", run, help=HELP)


def run(args: argparse.Namespace) -> int:
    return ci_impact.run_in_env(chosen_base(args))
