# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset rebase --onto VERSION`: port a series to another release."""

import argparse

from .. import worktree
from ..bases import get_base, previous_release
from .options import Subparsers, command_parser, path_option

HELP = "port a series to another release: three-way merge each patch onto its tag"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "rebase", run, base=False, help=HELP)
    parser.add_argument(
        "--onto",
        required=True,
        metavar="VERSION",
        help="the release to port to (declared in bases.toml, without a series yet)",
    )
    parser.add_argument(
        "--from",
        dest="source",
        metavar="VERSION",
        help="the series to port (default: the newest older base with one)",
    )
    path_option(parser, "--dest", "default: build/<onto>/work")


def run(args: argparse.Namespace) -> int:
    onto = get_base(args.onto)
    source = get_base(args.source) if args.source else previous_release(onto)
    dest = args.dest or worktree.default_worktree(onto)
    subjects = worktree.rebase(source, onto, dest)
    print(
        f"merged vLLM {source.version}'s {len(subjects)} patches onto "
        f"{onto.tag} in {dest}, one commit per patch, with no conflict.\n"
        "A textual merge is not a port: edit the work tree until the model "
        f"tests pass there, amend the commits, then run `scripts/patchset "
        f"refresh 1 --base {onto.version}` to write the series and overlay, "
        f"and `scripts/patchset test --base {onto.version}`."
    )
    return 0
