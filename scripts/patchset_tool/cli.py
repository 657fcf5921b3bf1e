# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command line of `scripts/patchset`: one subcommand per workflow step."""

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import apply, bisect, check, envmgr, export, paths, runner, testcmd, worktree
from .errors import PatchsetError
from .series import load_series


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
        print(
            f"{verb} {count} patches to {args.vllm_src} with git am -3 "
            f"({seconds:.2f} s)"
        )
        return 0 if args.check else upstream_tethering(args.vllm_src)
    if envmgr.env_python(require=False) is None:
        envmgr.setup()
    dest = None if args.check else (args.dest or paths.patched_tree())
    print(apply.apply_to_package(dest, force=args.force))
    return 0


def upstream_tethering(src: Path) -> int:
    """Run the checkout's own test-tethering hook on the test files the
    series adds, when the checkout has one."""
    script = src / "tools" / "pre_commit" / "check_test_tethering.py"
    added = [
        d.path
        for p in load_series(paths.PATCHES)
        for d in p.files
        if d.is_new and d.path.startswith("tests/") and d.path.endswith(".py")
    ]
    if not script.is_file() or not added:
        print(f"{src} has no {script.relative_to(src)}; upstream tethering not run")
        return 0
    python = envmgr.env_python(require=False)
    rc = subprocess.run([str(python or sys.executable), str(script), *added], cwd=src)
    status = "passes" if rc.returncode == 0 else f"FAILS (exit {rc.returncode})"
    print(f"upstream check_test_tethering.py on {len(added)} new test files: {status}")
    return rc.returncode


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


def cmd_worktree(args: argparse.Namespace) -> int:
    dest = args.dest or worktree.default_worktree()
    count = worktree.create(dest)
    print(
        f"work tree ready at {dest}: pristine vLLM {paths.VLLM_VERSION} "
        f"(tag {worktree.BASE_TAG}) plus {count} commits, one per patch.\n"
        "Edit it, then run `scripts/patchset refresh N`."
    )
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    work = args.vllm_src or worktree.default_worktree()
    if not work.is_dir():
        raise PatchsetError(
            f"{work}: no work tree; run `scripts/patchset "
            "worktree` first (or pass --vllm-src DIR)"
        )
    changed = worktree.refresh(args.number, work)
    print(
        f"refreshed from {work}: "
        + (", ".join(changed) if changed else "no patch changed")
        + "; vllm_overlay/ and tests follow"
    )
    return 0


def cmd_bisect_run(args: argparse.Namespace) -> int:
    return bisect.bisect_run(args.vllm_src, args.pytest_args)


def cmd_export(args: argparse.Namespace) -> int:
    description = args.pr_description or paths.build_dir() / "pr-description.md"
    count = export.export(args.vllm_src, args.branch, description)
    print(
        f"branch {args.branch} in {args.vllm_src}: {count} commits on HEAD; "
        f"pull-request description in {description}"
    )
    return 0


def cmd_test(args: argparse.Namespace) -> int:
    return testcmd.run_tests()


def cmd_report(module: str) -> Callable[[argparse.Namespace], int]:
    """The handler that runs report `module` against the chosen tree."""

    def run_report(args: argparse.Namespace) -> int:
        if envmgr.env_python(require=False) is None:
            envmgr.setup()
        return runner.run(
            ["python", "-m", f"patchset_tool.{module}", *args.report_args],
            base=args.base,
        )

    return run_report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patchset",
        description="Apply, verify and test the GLM-5.3-Flash series "
        f"against vLLM {paths.VLLM_VERSION} ({paths.VLLM_COMMIT}).",
    )
    sub = parser.add_subparsers(dest="subcommand", required=True)

    sub.add_parser(
        "setup", help="create or reuse the managed environment"
    ).set_defaults(func=cmd_setup)
    sub.add_parser("env", help="print the managed environment's python").set_defaults(
        func=cmd_env
    )

    p = sub.add_parser(
        "apply",
        help="apply the series (default: to a copy "
        "of the installed package under build/)",
    )
    p.add_argument(
        "--check", action="store_true", help="verify everything, write nothing"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="rebuild the patched tree even if it is up to date",
    )
    p.add_argument(
        "--vllm-src",
        type=Path,
        metavar="DIR",
        help="git am -3 onto this vLLM checkout instead",
    )
    p.add_argument(
        "--dest",
        type=Path,
        metavar="DIR",
        help="where to write the patched tree (default: build/vllm-patched)",
    )
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser(
        "run",
        help="run a command against the patched tree "
        "(or --base: the pristine install) on the CPU platform",
    )
    p.add_argument("--base", action="store_true")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_run)

    sub.add_parser("check", help="fast offline consistency check").set_defaults(
        func=cmd_check
    )

    p = sub.add_parser(
        "worktree",
        help="make a git work tree (pristine "
        "base + one commit per patch) to edit the series in",
    )
    p.add_argument("--dest", type=Path, metavar="DIR", help="default: build/work")
    p.set_defaults(func=cmd_worktree)

    p = sub.add_parser(
        "refresh",
        description="Regenerate patch N and later ones from the work tree, "
        "keeping each header; with N one past the end, turn the commit made "
        "after the series into a new patch.",
        help="regenerate patch N (and later ones) "
        "from the edited work tree; the overlay follows",
    )
    p.add_argument("number", type=int, metavar="N")
    p.add_argument(
        "--vllm-src",
        type=Path,
        metavar="DIR",
        help="the work tree (default: build/work)",
    )
    p.set_defaults(func=cmd_refresh)

    p = sub.add_parser(
        "bisect-run",
        help="for `git bisect run`: 125 when the "
        "series does not apply, else the glm5next tests' verdict",
    )
    p.add_argument("--vllm-src", type=Path, metavar="DIR", required=True)
    p.add_argument("pytest_args", nargs="*", metavar="PYTEST_ARG")
    p.set_defaults(func=cmd_bisect_run)

    p = sub.add_parser(
        "export",
        help="a branch with one commit per patch and the pull-request description",
    )
    p.add_argument("--vllm-src", type=Path, metavar="DIR", required=True)
    p.add_argument("--branch", required=True)
    p.add_argument(
        "--pr-description",
        type=Path,
        metavar="FILE",
        help="default: build/pr-description.md",
    )
    p.set_defaults(func=cmd_export)

    sub.add_parser(
        "test",
        help="the whole test command: check, tool tests, "
        "model tests on base and patched, tethering, lint",
    ).set_defaults(func=cmd_test)

    for module, text in (
        ("coverage", "which layers online quantization reaches"),
        ("capacity", "KV-cache tokens per budget, BF16 vs FP8"),
    ):
        p = sub.add_parser(module, help=text + " (on the meta device)", add_help=False)
        p.add_argument(
            "--base", action="store_true", help="report for the pristine install"
        )
        p.add_argument("report_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=cmd_report(module))
    return parser


REPORTS = ("coverage", "capacity")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] and argv[0] in REPORTS:
        # The report's own options pass through untouched (no `--` needed).
        args = parser.parse_args(argv[:1] + ["--base"] * ("--base" in argv))
        args.report_args = [a for a in argv[1:] if a not in ("--base", "--")]
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except PatchsetError as exc:
        print(f"patchset: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(
            "patchset: interrupted; nothing partial was left in place", file=sys.stderr
        )
        return 130
