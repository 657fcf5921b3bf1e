# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Options and look-ups that several commands share."""

import argparse
from pathlib import Path

from .. import envmgr
from ..bases import Base, get_base


def base_option(parser: argparse.ArgumentParser) -> None:
    """`--base VERSION`: which declared base the command works on."""
    parser.add_argument(
        "--base",
        metavar="VERSION",
        help="the vLLM release (see bases.toml; default: the primary base)",
    )


def vllm_src_option(
    parser: argparse.ArgumentParser, help: str, required: bool = False
) -> None:
    """`--vllm-src DIR`: a vLLM checkout or work tree, described by `help`."""
    parser.add_argument(
        "--vllm-src", type=Path, metavar="DIR", required=required, help=help
    )


def dest_option(parser: argparse.ArgumentParser, help: str) -> None:
    """`--dest DIR`: where the command writes, described by `help`."""
    parser.add_argument("--dest", type=Path, metavar="DIR", help=help)


def chosen_base(args: argparse.Namespace) -> Base:
    """The base named by --base, or the primary one."""
    return get_base(args.base)


def managed_python(base: Base) -> Path:
    """`base`'s managed python, setting its environment up first if
    there is none yet."""
    return envmgr.env_python(base, require=False) or envmgr.setup(base)
