# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset apply`: a base's patched tree, or its series on a checkout."""

import argparse
import sys
from pathlib import Path

from .. import apply, envmgr, upstream_checks
from ..series import Series
from .options import (
    base_option,
    chosen_base,
    dest_option,
    managed_python,
    vllm_src_option,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "apply",
        help="apply a base's series (default: to a copy "
        "of the installed package under build/<version>/)",
    )
    base_option(parser)
    parser.add_argument(
        "--check", action="store_true", help="verify everything, write nothing"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="rebuild the patched tree even if it is up to date",
    )
    vllm_src_option(parser, "git am -3 onto this vLLM checkout instead")
    dest_option(
        parser,
        "where to write the patched tree (default: build/<version>/vllm-patched)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    if args.vllm_src:
        return to_checkout(Series.load(base), args.vllm_src, args.check)
    managed_python(base)
    dest = None if args.check else (args.dest or base.patched_tree())
    print(apply.apply_to_package(base, dest, force=args.force))
    if args.check:
        return apply.report_tree(base, args.dest or base.patched_tree())
    return 0


def to_checkout(series: Series, src: Path, check: bool) -> int:
    """`git am -3` the series onto `src` (`check`: in a scratch worktree),
    then run the checkout's own tethering hook on the tests it adds."""
    count, seconds = apply.apply_to_checkout(series, src, check)
    verb = "would apply" if check else "applied"
    print(
        f"{verb} vLLM {series.base.version}'s {count} patches to {src} "
        f"with git am -3 ({seconds:.2f} s)"
    )
    if check:
        return 0
    python = envmgr.env_python(series.base, require=False) or Path(sys.executable)
    return upstream_checks.tether_new_tests(series, src, python)
