# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Command line of `scripts/patchset`: one subcommand per workflow step."""

import argparse
import importlib
import os
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from . import (
    apply,
    bisect,
    check,
    ci_impact,
    envmgr,
    export,
    gitutil,
    gpu,
    gpu_flashinfer,
    installed,
    paths,
    runner,
    sourcetree,
    testcmd,
    upstream_checks,
    wheel,
    worktree,
)
from .bases import Base, get_base, load_bases, release_order
from .errors import PatchsetError
from .junit import read_node_list
from .series import load_series


def chosen_base(args: argparse.Namespace) -> Base:
    """The base named by --base, or the primary one."""
    return get_base(args.base)


def cmd_setup(args: argparse.Namespace) -> int:
    for base in load_bases() if args.all else [chosen_base(args)]:
        start = time.monotonic()
        python = envmgr.setup(base)
        print(
            f"vLLM {base.version} environment ready: {python} "
            f"({time.monotonic() - start:.1f} s)"
        )
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    print(envmgr.env_python(chosen_base(args)))
    return 0


def cmd_apply(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    if args.vllm_src:
        count, seconds = apply.apply_to_checkout(base, args.vllm_src, args.check)
        verb = "would apply" if args.check else "applied"
        print(
            f"{verb} vLLM {base.version}'s {count} patches to {args.vllm_src} "
            f"with git am -3 ({seconds:.2f} s)"
        )
        return 0 if args.check else upstream_tethering(base, args.vllm_src)
    if envmgr.env_python(base, require=False) is None:
        envmgr.setup(base)
    dest = None if args.check else (args.dest or base.patched_tree())
    print(apply.apply_to_package(base, dest, force=args.force))
    if args.check:
        return apply.report_tree(base, args.dest or base.patched_tree())
    return 0


def upstream_tethering(base: Base, src: Path) -> int:
    """Run the checkout's own test-tethering hook on the test files the
    series adds, when the checkout has one."""
    script = src / "tools" / "pre_commit" / "check_test_tethering.py"
    added = [
        d.path
        for p in load_series(base.patches)
        for d in p.files
        if d.is_new and d.path.startswith("tests/") and d.path.endswith(".py")
    ]
    if not script.is_file() or not added:
        print(f"{src} has no {script.relative_to(src)}; upstream tethering not run")
        return 0
    python = envmgr.env_python(base, require=False)
    rc = subprocess.run([str(python or sys.executable), str(script), *added], cwd=src)
    status = "passes" if rc.returncode == 0 else f"FAILS (exit {rc.returncode})"
    print(f"upstream check_test_tethering.py on {len(added)} new test files: {status}")
    return rc.returncode


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise PatchsetError("run: no command given (use `run -- CMD ...`)", 2)
    return runner.run(command, chosen_base(args), pristine=args.pristine)


def cmd_check(args: argparse.Namespace) -> int:
    start = time.monotonic()
    for note in check.check():
        print(note)
    print(f"check passed in {time.monotonic() - start:.2f} s")
    return 0


def cmd_worktree(args: argparse.Namespace) -> int:
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


def cmd_refresh(args: argparse.Namespace) -> int:
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


def cmd_rebase(args: argparse.Namespace) -> int:
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


def previous_release(onto: Base) -> Base:
    """The newest declared base older than `onto` that has a series."""
    older = [
        b
        for b in release_order()
        if b.series_file.exists() and b.version_key < onto.version_key
    ]
    if not older:
        raise PatchsetError(f"no older base with a series to port onto {onto.tag}")
    return older[-1]


def cmd_bisect_run(args: argparse.Namespace) -> int:
    return bisect.bisect_run(chosen_base(args), args.vllm_src, args.pytest_args)


def cmd_export(args: argparse.Namespace) -> int:
    description = args.pr_description or paths.build_dir() / "pr-description.md"
    count = export.export(chosen_base(args), args.vllm_src, args.branch, description)
    print(
        f"branch {args.branch} in {args.vllm_src}: {count} commits on HEAD; "
        f"pull-request description in {description}"
    )
    return 0


def cmd_upstream_checks(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    python = envmgr.env_python(base, require=False) or envmgr.setup(base)
    return upstream_checks.run_checks(base, python)


def cmd_test(args: argparse.Namespace) -> int:
    bases = [chosen_base(args)] if args.base else load_bases()
    return testcmd.run_tests(bases, jobs=args.jobs)


BENCHMARK = paths.REPO / "benchmarks" / gpu.BENCH_SCRIPT
QUANT_BENCHMARK = paths.REPO / "benchmarks" / gpu.QUANT_BENCH_SCRIPT


def gpu_test_files(base: Base) -> list[Path]:
    """The tests to stage for an SM90 GPU: the files of the verification
    suite (one copy for every base) that its expected-skips list names, and
    any other test file of `base`'s series that the base's list names (the
    suite's copy wins over a series file of the same name)."""
    suite = sorted(
        {
            paths.REPO / name.split("::", 1)[0]
            for name in read_node_list(paths.SUITE_EXPECTED_SKIPS)
        }
    )
    skipped = {name.split("::", 1)[0] for name in read_node_list(base.expected_skips)}
    ours = sorted(skipped & set(sourcetree.series_test_files(base)))
    names = {test.name for test in suite}
    return suite + [base.copy_of(f) for f in ours if Path(f).name not in names]


def cmd_gpu(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    results = paths.build_dir() / "gpu" / f"results-{base.version}"
    if args.collect:
        print(gpu.collect(args.collect, results))
        return 0
    if envmgr.env_python(base, require=False) is None:
        envmgr.setup(base)
    runner.ensure_patched_tree(base)
    if args.bench == "quant":
        return stage_quant_bench(base)
    dest = paths.build_dir() / "gpu" / f"stage-{base.version}"
    tests = gpu_test_files(base)
    if not tests:
        raise PatchsetError(f"{base.expected_skips}: names no GPU test to stage")
    archives: tuple[Path, ...] = ()
    if args.bench and base.primary:
        python = envmgr.env_python(base)
        assert python is not None
        archives = (
            gpu_flashinfer.archive(
                envmgr.site_packages(python),
                python,
                paths.cache_root() / "gpu-flashinfer",
            ),
        )
    try:
        gpu.stage(
            base.patched_tree(),
            tests,
            dest,
            cache_dir=paths.cache_root() / "gpu-xz",
            bench=BENCHMARK if args.bench else None,
            archives=archives,
            beside=gitutil.working_tree_bytes(paths.REPO),
        )
    except ValueError as exc:
        raise PatchsetError(str(exc)) from exc
    stage_rel = dest.relative_to(paths.REPO).as_posix()
    print(
        f"staged {len(tests)} test file(s) for vLLM {base.version} in {dest}.\n"
        f"On the H200, from a copy of this repository carrying {stage_rel}, run:\n"
        f"  {gpu.device_command(stage_rel, bench=bool(args.bench))}\n"
        "then bring back $OUT and run: "
        f"scripts/patchset gpu --base {base.version} --collect DIR"
    )
    return 0


def stage_quant_bench(base: Base) -> int:
    """Stage the online-quantization benchmark alone (no tests), with the
    verification suite's config.json of GLM-5.3-Flash."""
    dest = paths.build_dir() / "gpu" / f"stage-quant-{base.version}"
    config = paths.SUITE / "glm-5.3-flash-config.json"
    try:
        gpu.stage(
            base.patched_tree(),
            [],
            dest,
            cache_dir=paths.cache_root() / "gpu-xz",
            bench=QUANT_BENCHMARK,
            bench_files=(BENCHMARK, config),
            python_files=gpu.PYTHON_FILES + gpu.QUANT_PYTHON_FILES,
            beside=gitutil.working_tree_bytes(paths.REPO),
        )
    except (FileNotFoundError, ValueError) as exc:
        raise PatchsetError(str(exc)) from exc
    stage_rel = dest.relative_to(paths.REPO).as_posix()
    command = gpu.device_command(
        stage_rel, bench=True, script=gpu.QUANT_BENCH_SCRIPT, tests=False
    )
    print(
        f"staged the online-quantization benchmark for vLLM {base.version} in "
        f"{dest}.\nOn the H200, from a copy of this repository carrying "
        f"{stage_rel}, run:\n  {command}\nthen bring back $OUT and run: "
        f"scripts/patchset gpu --base {base.version} --collect DIR"
    )
    return 0


def cmd_report(module: str) -> Callable[[argparse.Namespace], int]:
    """The handler that runs report `module` against the chosen tree."""

    def run_report(args: argparse.Namespace) -> int:
        if {"-h", "--help"} & set(args.report_args):
            # Help needs no environment and no patched tree.
            reports = importlib.import_module("patchset_tool.reports.cli")
            reports.parse_report_args([module, "--help"])
        base = chosen_base(args)
        if envmgr.env_python(base, require=False) is None:
            envmgr.setup(base)
        # vLLM logs to stdout by default; keep stdout for the report alone,
        # so that `--json` output parses.
        os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
        return runner.run(
            ["python", "-m", "patchset_tool.reports", module, *args.report_args],
            base,
            pristine=args.pristine,
            suite=True,
        )

    return run_report


def _base_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--base",
        metavar="VERSION",
        help="the vLLM release (see bases.toml; default: the primary base)",
    )


START_HERE = """\
where to start:
  scripts/patchset setup                 the managed environment (once)
  scripts/patchset apply                 the patched tree in build/<version>/
  scripts/patchset run -- pytest ...     a command against that tree
  scripts/patchset worktree              a git work tree to edit the series;
  scripts/patchset refresh N             then write patch N back from it
  scripts/patchset test                  everything, before sending
Each subcommand has its own --help."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="patchset",
        description="Apply, verify and test the GLM-5.3-Flash series against "
        "the vLLM releases declared in bases.toml.",
        epilog=START_HERE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="subcommand", required=True)

    p = sub.add_parser("setup", help="create or reuse a base's managed environment")
    _base_option(p)
    p.add_argument("--all", action="store_true", help="every declared base")
    p.set_defaults(func=cmd_setup)
    p = sub.add_parser("env", help="print a base's managed python")
    _base_option(p)
    p.set_defaults(func=cmd_env)

    p = sub.add_parser(
        "apply",
        help="apply a base's series (default: to a copy "
        "of the installed package under build/<version>/)",
    )
    _base_option(p)
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
        help="where to write the patched tree (default: build/<version>/vllm-patched)",
    )
    p.set_defaults(func=cmd_apply)

    p = sub.add_parser(
        "run",
        help="run a command against the patched tree "
        "(or --pristine: the unpatched install) on the CPU platform",
    )
    _base_option(p)
    p.add_argument(
        "--pristine", action="store_true", help="the unpatched install instead"
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after `--`: the command, run in the current directory",
    )
    p.set_defaults(func=cmd_run)

    sub.add_parser(
        "check", help="fast offline consistency check of every base's series"
    ).set_defaults(func=cmd_check)

    p = sub.add_parser(
        "worktree",
        help="make a git work tree (pristine "
        "release source + one commit per patch) to edit the series in",
    )
    _base_option(p)
    p.add_argument(
        "--dest", type=Path, metavar="DIR", help="default: build/<version>/work"
    )
    p.set_defaults(func=cmd_worktree)

    p = sub.add_parser(
        "refresh",
        description="Regenerate patch N and later ones from the work tree, "
        "keeping each header; with N one past the end, turn the commit made "
        "after the series into a new patch. For a base with no series yet "
        "(after `rebase --onto`), write its series from the work tree.",
        help="regenerate patch N (and later ones) "
        "from the edited work tree; the overlay follows",
    )
    _base_option(p)
    p.add_argument("number", type=int, metavar="N")
    p.add_argument(
        "--vllm-src",
        type=Path,
        metavar="DIR",
        help="the work tree (default: build/<version>/work)",
    )
    p.set_defaults(func=cmd_refresh)

    p = sub.add_parser(
        "rebase",
        help="port a series to another release: three-way merge each patch "
        "onto its tag in a new work tree",
    )
    p.add_argument("--onto", required=True, metavar="VERSION")
    p.add_argument(
        "--from",
        dest="source",
        metavar="VERSION",
        help="the series to port (default: the newest older base with one)",
    )
    p.add_argument(
        "--dest", type=Path, metavar="DIR", help="default: build/<onto>/work"
    )
    p.set_defaults(func=cmd_rebase)

    p = sub.add_parser(
        "bisect-run",
        help="for `git bisect run`: 125 when the "
        "series does not apply, else the glm5next tests' verdict",
    )
    _base_option(p)
    p.add_argument(
        "--vllm-src",
        type=Path,
        metavar="DIR",
        required=True,
        help="the vLLM checkout `git bisect` moves",
    )
    p.add_argument(
        "pytest_args",
        nargs="*",
        metavar="PYTEST_ARG",
        help="passed to pytest after the series' test files",
    )
    p.set_defaults(func=cmd_bisect_run)

    p = sub.add_parser(
        "export",
        help="a branch with one commit per patch, authored and signed off by "
        "you, and the pull-request description",
    )
    _base_option(p)
    p.add_argument(
        "--vllm-src",
        type=Path,
        metavar="DIR",
        required=True,
        help="your vLLM checkout; its work tree is left alone",
    )
    p.add_argument("--branch", required=True, help="the new branch's name")
    p.add_argument(
        "--pr-description",
        type=Path,
        metavar="FILE",
        help="default: build/pr-description.md",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "test",
        help="the whole test command: check, tool tests, and per base the "
        "model tests on pristine and patched, lint and upstream's gates",
    )
    _base_option(p)
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="parts run side by side, and pytest-xdist workers of the tool's "
        "tests (default: the number of cores)",
    )
    p.set_defaults(func=cmd_test)

    p = sub.add_parser(
        "upstream-checks",
        help="upstream's own check_test_tethering.py and check_spdx_header.py "
        "(from the base's release source) over this repository",
    )
    _base_option(p)
    p.set_defaults(func=cmd_upstream_checks)

    p = sub.add_parser(
        "ci-impact",
        help="which of the base's Buildkite steps a PR with the series "
        "triggers, and which of their tests `test` runs here",
    )
    _base_option(p)
    p.set_defaults(func=ci_impact.cmd_ci_impact)

    p = sub.add_parser(
        "gpu",
        help="stage the SM90 tests (and --bench, the decode benchmark) with "
        "the base's kernels for an H200 machine; --collect its results",
    )
    _base_option(p)
    p.add_argument(
        "--bench",
        nargs="?",
        const="decode",
        choices=("decode", "quant"),
        help=(
            "stage the KV-cache decode benchmark too (on the primary base with "
            "FlashInfer's SM90 MLA, compiled here with nvcc; the other bases' "
            "stages leave no room for it); `--bench quant`: stage the "
            "online-quantization linear benchmark alone"
        ),
    )
    p.add_argument(
        "--collect",
        type=Path,
        metavar="DIR",
        help="copy a device run's $OUT files into build/gpu/results-<version>",
    )
    p.set_defaults(func=cmd_gpu)

    p = sub.add_parser(
        "build",
        help="a pip-installable vLLM wheel with the base's series, in dist/",
    )
    _base_option(p)
    p.add_argument("--dist", type=Path, metavar="DIR", help="default: dist/")
    p.set_defaults(func=wheel.cmd_build)

    p = sub.add_parser(
        "verify-install",
        help="which vLLM and series an environment holds, and whether its "
        "files still match RECORD (exit 1 on drift)",
    )
    p.add_argument(
        "python",
        nargs="?",
        type=Path,
        metavar="PYTHON|DIR",
        help="the environment's interpreter (default: python3 on PATH), or "
        "the folder of a `pip install --target DIR`",
    )
    p.set_defaults(func=installed.cmd_verify_install)

    for module, text in (
        ("coverage", "which layers online quantization reaches"),
        ("capacity", "KV-cache tokens per budget, BF16 vs FP8"),
    ):
        p = sub.add_parser(module, help=text + " (on the meta device)", add_help=False)
        _base_option(p)
        p.add_argument(
            "--pristine", action="store_true", help="report for the unpatched install"
        )
        p.add_argument("report_args", nargs=argparse.REMAINDER)
        p.set_defaults(func=cmd_report(module))
    return parser


REPORTS = ("coverage", "capacity")


def _split_report_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the tool's own options, the report's options) of a report command:
    --base VERSION and --pristine are the tool's, the rest pass through."""
    own, rest = argv[:1], []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--pristine":
            own.append(arg)
        elif arg == "--base":
            own += [arg, next(args, "")]
        elif arg.startswith("--base="):
            own.append(arg)
        elif arg != "--":
            rest.append(arg)
    return own, rest


EXPECTED_FAULTS = (
    OSError,
    ValueError,
    subprocess.CalledProcessError,
    zipfile.BadZipFile,
)
"""Faults of the machine or of a file (missing, unreadable, read-only,
disk full, not JSON, a failed helper process): one line, not a traceback."""
DEBUG_VAR = "PATCHSET_DEBUG"


def describe_fault(exc: BaseException) -> str:
    """One line naming what failed and where."""
    if isinstance(exc, OSError) and exc.filename is not None:
        where = exc.filename
        if exc.filename2 is not None:
            where = f"{where} -> {exc.filename2}"
        return f"{where}: {exc.strerror or exc}"
    if isinstance(exc, subprocess.CalledProcessError):
        command = exc.cmd if isinstance(exc.cmd, str) else " ".join(map(str, exc.cmd))
        return f"`{command}` exited {exc.returncode}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{text} ({type(exc).__name__}; {DEBUG_VAR}=1 shows the traceback)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] and argv[0] in REPORTS:
        # The report's own options pass through untouched (no `--` needed).
        own, rest = _split_report_args(argv)
        args = parser.parse_args(own)
        args.report_args = rest
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except PatchsetError as exc:
        print(f"patchset: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except EXPECTED_FAULTS as exc:
        if os.environ.get(DEBUG_VAR):
            raise
        print(f"patchset: error: {describe_fault(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "patchset: interrupted; nothing partial was left in place", file=sys.stderr
        )
        return 130
