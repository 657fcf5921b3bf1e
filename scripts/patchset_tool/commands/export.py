# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset export`: a branch with one commit per patch, and the PR description."""

import argparse
from pathlib import Path

from .. import export, paths
from ..series import Series
from .options import base_option, chosen_base, vllm_src_option


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="a branch with one commit per patch, authored and signed off by "
        "you, and the pull-request description",
    )
    base_option(parser)
    vllm_src_option(
        parser, "your vLLM checkout; its work tree is left alone", required=True
    )
    parser.add_argument("--branch", required=True, help="the new branch's name")
    parser.add_argument(
        "--pr-description",
        type=Path,
        metavar="FILE",
        help="default: build/pr-description.md",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    description = args.pr_description or paths.build_dir() / "pr-description.md"
    series = Series.load(chosen_base(args))
    count = export.export(series, args.vllm_src, args.branch, description)
    print(
        f"branch {args.branch} in {args.vllm_src}: {count} commits on HEAD; "
        f"pull-request description in {description}"
    )
    return 0
