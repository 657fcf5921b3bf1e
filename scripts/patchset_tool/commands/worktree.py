# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset worktree`: a git work tree to edit a base's series in."""

import argparse

from .. import worktree
from .options import Subparsers, chosen_base, command_parser, path_option

HELP = "make a git work tree (release source + a commit per patch) to edit the series"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "worktree", run, help=HELP)
    path_option(parser, "--dest", "default: build/<version>/work")


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
