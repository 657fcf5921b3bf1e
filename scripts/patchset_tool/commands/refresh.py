# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset refresh N`: write patch N (and later ones) back from the work tree."""

import argparse

from .. import worktree
from ..errors import PatchsetError
from .options import Subparsers, chosen_base, command_parser, path_option

DESCRIPTION = (
    "Regenerate patch N and later ones from the work tree, "
    "keeping each header; with N one past the end, turn the commit made "
    "after the series into a new patch. For a base with no series yet "
    "(after `rebase --onto`), write its series from the work tree."
)
HELP = "regenerate patch N (and later ones) from the work tree; the overlay follows"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(
        subparsers, "refresh", run, description=DESCRIPTION, help=HELP
    )
    parser.add_argument(
        "number",
        type=int,
        metavar="N",
        help="the patch to regenerate, from 1 (one past the last: a new patch)",
    )
    path_option(parser, "--vllm-src", "the work tree (default: build/<version>/work)")


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    work = args.vllm_src or worktree.default_worktree(base)
    if not work.is_dir():
        raise PatchsetError(
            f"{work}: no work tree; run `scripts/patchset worktree --base "
            f"{base.version}` first (or pass --vllm-src DIR)"
        )
    changed = worktree.refresh(args.number, work, base)
    print(
        f"refreshed vLLM {base.version}'s series from {work}: "
        + (", ".join(changed) if changed else "no patch changed")
        + f"; {base.overlay.name}'s overlay follows"
    )
    return 0
