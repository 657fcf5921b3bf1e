# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset export`: a branch with one commit per patch, and the PR description."""

import argparse

from .. import export, paths
from ..series import Series
from .options import Subparsers, chosen_base, command_parser, path_option

HELP = "a branch with one commit per patch, signed off by you, and the PR description"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "export", run, help=HELP)
    path_option(
        parser,
        "--vllm-src",
        "your vLLM checkout; its work tree is left alone",
        required=True,
    )
    parser.add_argument("--branch", required=True, help="the new branch's name")
    path_option(parser, "--pr-description", "default: build/pr-description.md", "FILE")


def run(args: argparse.Namespace) -> int:
    description = args.pr_description or paths.build_dir() / "pr-description.md"
    series = Series.load(chosen_base(args))
    count = export.export(series, args.vllm_src, args.branch, description)
    print(
        f"branch {args.branch} in {args.vllm_src}: {count} commits on HEAD; "
        f"pull-request description in {description}"
    )
    return 0
