# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset gpu`: stage the SM90 tests or a benchmark for an H200, and
collect a device run's results."""

import argparse

from .. import envmgr, gpu, gpu_stage, runner
from ..series import Series
from .options import Subparsers, chosen_base, command_parser, path_option

HELP = "stage the SM90 tests (--bench: a benchmark) for an H200; --collect its results"


def register(subparsers: Subparsers) -> None:
    parser = command_parser(subparsers, "gpu", run, help=HELP)
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
    path_option(
        parser, "--collect", "copy a device run's $OUT into build/gpu/results-<V>"
    )


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    if args.collect:
        print(gpu.collect(args.collect, gpu_stage.results_dir(base)))
        return 0
    envmgr.setup(base)
    runner.ensure_patched_tree(base)
    if args.bench == "quant":
        print(gpu_stage.stage_quant_bench(base))
    else:
        print(gpu_stage.stage_tests(Series.load(base), bench=bool(args.bench)))
    return 0
