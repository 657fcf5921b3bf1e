# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Options and look-ups that several commands share."""

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

from ..bases import Base, get_base

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What each command's `register` adds its parser to."""


PARSERS: dict[str, argparse.ArgumentParser] = {}
"""Each command's parser by name, so that an unknown option is answered
with that command's usage."""
BASE_DEFAULT = "the primary base"


def base_option(parser: argparse.ArgumentParser, default: str = BASE_DEFAULT) -> None:
    """`--base VERSION`: which declared base the command works on."""
    parser.add_argument(
        "--base",
        metavar="VERSION",
        help=f"the vLLM release (see bases.toml; default: {default})",
    )


def positive_int(text: str) -> int:
    """An argparse type: a whole number of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a whole number"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def flag(parser: argparse.ArgumentParser, name: str, help: str) -> None:
    """An on/off option `name` (off unless given)."""
    parser.add_argument(name, action="store_true", help=help)


def path_option(
    parser: argparse.ArgumentParser,
    name: str,
    help: str,
    metavar: str = "DIR",
    required: bool = False,
) -> None:
    """An option `name` that names a path (`--vllm-src`, `--dest`, ...)."""
    parser.add_argument(name, type=Path, metavar=metavar, required=required, help=help)


def command_parser(
    subparsers: Subparsers,
    name: str,
    run: Callable[[argparse.Namespace], int],
    base: bool = True,
    base_default: str = BASE_DEFAULT,
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """The parser of command `name` (`kwargs`: its help and description),
    with `run` as its handler and, unless `base` is False, `--base` as
    its first option (`base_default`: what its help says it defaults to)."""
    parser = subparsers.add_parser(name, **kwargs)
    PARSERS[name] = parser
    if base:
        base_option(parser, base_default)
    parser.set_defaults(func=run)
    return parser


def chosen_base(args: argparse.Namespace) -> Base:
    """The base named by --base, or the primary one."""
    return get_base(args.base)
