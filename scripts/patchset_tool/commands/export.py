# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset export`: one branch per patch, signed off by you, each with its
pull-request description; `--check FILE` validates a description."""

import argparse
import tarfile
from pathlib import Path

from .. import export, paths, prdesc, testcmd, upstream
from ..bases import Base
from ..errors import PatchsetError
from ..neighbours import LIST as NEIGHBOURS
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
            "signed off by your git identity alone, and write one pull-request "
            "description per branch from the patches, docs/measurements.md "
            "and the latest `scripts/patchset test` logs. All or nothing."
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
        "validate this description instead: the template's headings, every "
        "figure traced to docs/measurements.md or a test log, no placeholder "
        "identity, no hard-wrapped paragraph",
        "FILE",
    )


def sources(base: Base) -> prdesc.Sources:
    """Where the evidence for `base` lives in this repository."""
    return prdesc.Sources(
        version=base.version,
        measurements=paths.REPO / "docs" / "measurements.md",
        readme=paths.REPO / "README.md",
        pristine_log=testcmd.log_path(testcmd.model_part(base.version, False)),
        patched_log=testcmd.log_path(testcmd.model_part(base.version, True)),
        neighbours_log=testcmd.log_path(testcmd.neighbours_part(base.version)),
        neighbours_list=NEIGHBOURS,
        expected_failures=base.expected_base_failures,
        gpu_results=paths.build_dir() / "gpu" / f"results-{base.version}",
        sm90_pristine_log=testcmd.log_path(
            testcmd.model_part(base.version, False, testcmd.SM90_HOST)
        ),
        sm90_patched_log=testcmd.log_path(
            testcmd.model_part(base.version, True, testcmd.SM90_HOST)
        ),
    )


def sdist_template(base: Base) -> str | None:
    """The PR template in the release's sdist (sha256-checked, cached)."""
    member = f"vllm-{base.version}/{export.TEMPLATE}"
    try:
        with tarfile.open(upstream.sdist(base.version)) as tar:
            handle = tar.extractfile(member)
            return handle.read().decode() if handle else None
    except (KeyError, OSError, tarfile.TarError):
        return None


def template_for(base: Base, src: Path | None) -> str:
    found = export.release_template(src) if src else None
    found = found or sdist_template(base)
    if found is None:
        raise PatchsetError(
            f"export: no {export.TEMPLATE} in the checkout or vLLM "
            f"{base.version}'s sdist"
        )
    return found


def check_file(base: Base, args: argparse.Namespace) -> int:
    try:
        if not args.check.is_file():  # a pipe or a device may never end
            raise OSError("not a regular file")
        with open(args.check, "rb") as handle:
            data = handle.read(LIMIT + 1)
        if len(data) > LIMIT:
            raise OSError(f"over {LIMIT >> 20} MiB, not a description")
        text = data.decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise PatchsetError(
            f"export --check: {args.check}: cannot read it: {exc}"
        ) from exc
    evidence = prdesc.Evidence.read(sources(base))
    problems = prdesc.check(text, template_for(base, args.vllm_src), evidence)
    for problem in problems:
        print(f"{args.check}: {problem}")
    if not problems:
        print(f"{args.check}: ok (headings, figures, identity, paragraphs)")
    return 1 if problems else 0


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    if args.check:
        return check_file(base, args)
    if args.vllm_src is None:
        raise PatchsetError("export: --vllm-src DIR is required (or --check FILE)")
    series = Series.load(base)
    out_dir = args.pr_dir or paths.build_dir() / "pr-descriptions"
    evidence = prdesc.Evidence.read(sources(base))
    exported, release = export.export(
        series,
        args.vllm_src,
        args.branch,
        out_dir,
        evidence,
        lambda: sdist_template(base),
    )
    print(release)
    for item in exported:
        print(
            f"branch {item.branch}: {item.patch.subject}\n"
            f"  on {item.base} ({item.reason}); commit {item.commit[:12]}\n"
            f"  description: {item.description}"
        )
        if item.not_run:
            print(f"  not run (said so in it): {'; '.join(item.not_run)}")
        if item.untraced:
            print(
                f"  left out, no source holds: {'; '.join(item.untraced[:5])}"
                + (
                    f" (+{len(item.untraced) - 5} more)"
                    if len(item.untraced) > 5
                    else ""
                )
            )
    return 0
