# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command line of `scripts/patchset`: one subcommand per workflow step."""

import argparse
import sys
import time
from pathlib import Path

from . import apply, check, envmgr, paths, runner
from .errors import PatchsetError


def cmd_setup(args: argparse.Namespace) -> int:
    start = time.monotonic()
    python = envmgr.setup()
    print(f"environment ready: {python} ({time.monotonic() - start:.1f} s)")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    print(envmgr.env_python())
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    if args.vllm_src:
        count, seconds = apply.apply_to_checkout(args.vllm_src, args.check)
        verb = "would apply" if args.check else "applied"
        print(f"{verb} {count} patches to {args.vllm_src} with git am -3 "
              f"({seconds:.2f} s)")
        return 0
    if envmgr.env_python(require=False) is None:
        envmgr.setup()
    dest = None if args.check else (args.dest or paths.patched_tree())
    print(apply.apply_to_package(dest))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise PatchsetError("run: no command given (use `run -- CMD ...`)", 2)
    return runner.run(command, base=args.base)


def cmd_check(args: argparse.Namespace) -> int:
    start = time.monotonic()
    for note in check.check():
        print(note)
    print(f"check passed in {time.monotonic() - start:.2f} s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patchset",
        description="Apply, verify and test the GLM-5.3-Flash series "
                    f"against vLLM {paths.VLLM_VERSION} ({paths.VLLM_COMMIT}).")
    sub = parser.add_subparsers(dest="subcommand", required=True)

    sub.add_parser("setup", help="create or reuse the managed environment"
                   ).set_defaults(func=cmd_setup)
    sub.add_parser("env", help="print the managed environment's python"
                   ).set_defaults(func=cmd_env)

    p = sub.add_parser("apply", help="apply the series (default: to a copy "
                       "of the installed package under build/)")
    p.add_argument("--check", action="store_true",
                   help="verify everything, write nothing")
    p.add_argument("--vllm-src", type=Path, metavar="DIR",
                   help="git am -3 onto this vLLM checkout instead")
    p.add_argument("--dest", type=Path, metavar="DIR",
                   help=f"where to write the patched tree "
                        f"(default: build/vllm-patched)")
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser("run", help="run a command against the patched tree "
                       "(or --base: the pristine install) on the CPU platform")
    p.add_argument("--base", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_run)

    sub.add_parser("check", help="fast offline consistency check"
                   ).set_defaults(func=cmd_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except PatchsetError as exc:
        print(f"patchset: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("patchset: interrupted; nothing partial was left in place",
              file=sys.stderr)
        return 130
