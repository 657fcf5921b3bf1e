# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset worktree`: a git work tree to edit a base's series in."""

import argparse

from .. import worktree
from .options import base_option, chosen_base, dest_option


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worktree",
        help="make a git work tree (pristine "
        "release source + one commit per patch) to edit the series in",
    )
    base_option(parser)
    dest_option(parser, "default: build/<version>/work")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    dest = args.dest or worktree.default_worktree(base)
    count, reused = worktree.create(dest, base)
    state = "reused" if reused else "ready"
    print(
        f"work tree {state} at {dest}: pristine vLLM {base.version} "
        f"(tag {worktree.BASE_TAG}) plus {count} commits, one per patch.\n"
        f"Edit it, then run `scripts/patchset refresh N --base {base.version}`."
    )
    return 0
