# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset export`: one branch per patch, signed off by you, each with its
hand-written pull-request description; `--check FILE` validates one."""

import argparse
import tarfile
from pathlib import Path

from .. import export, gitutil, paths, prdesc, upstream
from ..bases import Base
from ..errors import PatchsetError
from ..series import Series
from .options import Subparsers, chosen_base, command_parser, path_option

HELP = "one branch per patch, signed off by you, each with its PR description"
LIMIT = 1 << 20
"""The most bytes of a description `--check` reads (one is a few KiB)."""


def register(subparsers: Subparsers) -> None:
    parser = command_parser(
        subparsers,
        "export",
        run,
        help=HELP,
        description=(
            "Make one branch per patch in your vLLM checkout (patch 1 on its "
            "HEAD; a later patch on HEAD too when it applies and works alone, "
            "else on the previous patch's branch), each commit authored and "
            "signed off by your git identity alone, and copy each patch's "
            "description (docs/pr/NNNN.md, checked as --check checks it) "
            "beside its branch's name. All or nothing."
        ),
    )
    path_option(parser, "--vllm-src", "your vLLM checkout; its work tree is left alone")
    parser.add_argument(
        "--branch",
        action="append",
        metavar="NAME",
        help=(
            "a new branch's name, once per patch in the series' order "
            "(default: glm5next/<patch file name>)"
        ),
    )
    path_option(
        parser,
        "--pr-dir",
        "where the descriptions go, a folder the tool makes "
        "(default: build/pr-descriptions)",
    )
    path_option(
        parser,
        "--check",
        "validate this description instead: the template's headings, the word "
        "limits, every figure in docs/measurements.md, no path vLLM lacks, "
        "no test run that no recorded log shows",
        "FILE",
    )


def vllm_files(base: Base, src: Path | None) -> set[str]:
    """The files of vLLM with the series: `src`'s tracked files, else those
    of the release's sdist (sha256-checked, cached)."""
    if src is not None:
        listed = gitutil.git("ls-files", "-z", cwd=src).stdout.split("\0")
    else:
        with tarfile.open(upstream.sdist(base.version)) as tar:
            listed = [n.partition("/")[2] for n in tar.getnames()]
    return {f for f in listed if f} | set(Series.load(base).touched)


def records(base: Base, src: Path | None) -> prdesc.Records:
    files = vllm_files(base, src)
    known = files | {str(p) for f in files for p in Path(f).parents}

    def in_vllm(path: str) -> bool:
        path = path.strip("/")
        return path in known or f"tests/{path}" in known

    build = paths.build_dir()
    logs = sorted((build / "test-logs").glob("*.log"))
    logs += sorted(
        p for p in (build / "gpu").rglob("*") if p.suffix in (".xml", ".log")
    )
    return prdesc.Records.read(paths.REPO / "docs" / "measurements.md", logs, in_vllm)


def read(path: Path) -> str:
    try:
        if not path.is_file():  # a pipe or a device may never end
            raise OSError("not a regular file")
        with open(path, "rb") as handle:
            data = handle.read(LIMIT + 1)
        if len(data) > LIMIT:
            raise OSError(f"over {LIMIT >> 20} MiB, not a description")
        return data.decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise PatchsetError(f"export: {path}: cannot read it ({exc})") from None


def descriptions(series: Series, found: prdesc.Records) -> list[str]:
    """Each patch's written description, checked; raise naming the first
    missing or failing one."""
    texts = []
    for patch in series.patches:
        path = paths.REPO / "docs" / "pr" / f"{patch.name[:4]}.md"
        if not path.is_file():
            raise PatchsetError(
                f"export: {path} is missing: write {patch.name}'s description "
                "there first; nothing was created"
            )
        text = read(path)
        if problems := prdesc.check(text, found):
            raise PatchsetError(
                f"export: {path}: {problems[0]} (export --check {path} lists "
                "all); nothing was created"
            )
        texts.append(text)
    return texts


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    if args.check:
        problems = prdesc.check(read(args.check), records(base, args.vllm_src))
        for problem in problems:
            print(f"{args.check}: {problem}")
        if not problems:
            print(f"{args.check}: ok (headings, length, figures, paths, test runs)")
        return 1 if problems else 0
    if args.vllm_src is None:
        raise PatchsetError("export: --vllm-src DIR is required (or --check FILE)")
    series = Series.load(base)
    gitutil.require_clean_checkout(args.vllm_src)
    texts = descriptions(series, records(base, args.vllm_src))
    out_dir = args.pr_dir or paths.build_dir() / "pr-descriptions"
    exported, release = export.export(
        series, args.vllm_src, args.branch, out_dir, texts
    )
    print(release)
    for item in exported:
        print(
            f"branch {item.branch}: {item.patch.subject}\n"
            f"  on {item.base} ({item.reason}); commit {item.commit[:12]}\n"
            f"  description: {item.description}"
        )
    return 0
