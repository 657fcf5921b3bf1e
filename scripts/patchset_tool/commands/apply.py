# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset apply`: a base's patched tree, or its series on a checkout."""

import argparse
import sys
from pathlib import Path

from .. import apply, envmgr, upstream_checks
from ..series import Series
from .options import Subparsers, chosen_base, command_parser, flag, path_option

HELP = "apply a base's series (default: to a copy of the install, build/<version>/)"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "apply", run, help=HELP)
    flag(
        parser,
        "--check",
        "verify everything, write nothing (needs the environment that "
        "`setup` or a plain `apply` makes)",
    )
    flag(parser, "--force", "rebuild the patched tree even if it is up to date")
    path_option(parser, "--vllm-src", "git am -3 onto this vLLM checkout instead")
    flag(
        parser,
        "--other-release",
        "with --vllm-src: merge onto a checkout of another release (refused otherwise)",
    )
    path_option(
        parser, "--dest", "the patched tree (default: build/<version>/vllm-patched)"
    )


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    if args.vllm_src:
        return to_checkout(
            Series.load(base), args.vllm_src, args.check, args.other_release
        )
    if not args.check:
        envmgr.setup(base)  # --check writes nothing: it needs an environment
    dest = None if args.check else (args.dest or base.patched_tree())
    print(apply.apply_to_package(base, dest, force=args.force))
    if args.check:
        return apply.report_tree(base, args.dest or base.patched_tree())
    return 0


def to_checkout(
    series: Series, src: Path, check: bool, other_release: bool = False
) -> int:
    """`git am -3` the series onto `src` (via a scratch clone; `check`:
    there alone), then run the checkout's tethering hook on the tests it adds."""
    count, seconds = apply.apply_to_checkout(series, src, check, other_release)
    verb = "would apply" if check else "applied"
    print(
        f"{verb} vLLM {series.base.version}'s {count} patches to {src} "
        f"with git am -3 ({seconds:.2f} s)"
    )
    if check:
        return 0
    python = envmgr.env_python(series.base, require=False) or Path(sys.executable)
    return upstream_checks.tether_new_tests(series, src, python)
