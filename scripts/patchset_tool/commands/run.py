# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset run`: a command against a base's patched tree or pristine install."""

import argparse

from .. import runner
from ..errors import PatchsetError
from .options import Subparsers, chosen_base, command_parser, flag

HELP = "run a command against the patched tree (--pristine: the unpatched install)"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "run", run, help=HELP)
    flag(parser, "--pristine", "the unpatched install instead")
    parser.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after `--`: the command, run in the current directory",
    )


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise PatchsetError("run: no command given (use `run -- CMD ...`)", 2)
    return runner.run(command, chosen_base(args), pristine=args.pristine)
