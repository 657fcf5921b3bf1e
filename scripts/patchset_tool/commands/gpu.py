# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset gpu`: stage the SM90 tests or a benchmark for an H200, and
collect a device run's results."""

import argparse
from pathlib import Path

from .. import gpu, gpu_stage, runner
from ..series import Series
from .options import base_option, chosen_base, managed_python


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "gpu",
        help="stage the SM90 tests (and --bench, the decode benchmark) with "
        "the base's kernels for an H200 machine; --collect its results",
    )
    base_option(parser)
    parser.add_argument(
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
    parser.add_argument(
        "--collect",
        type=Path,
        metavar="DIR",
        help="copy a device run's $OUT files into build/gpu/results-<version>",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    if args.collect:
        print(gpu.collect(args.collect, gpu_stage.results_dir(base)))
        return 0
    managed_python(base)
    runner.ensure_patched_tree(base)
    if args.bench == "quant":
        print(gpu_stage.stage_quant_bench(base))
    else:
        print(gpu_stage.stage_tests(Series.load(base), bench=bool(args.bench)))
    return 0
