# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`patchset gpu`: stage the SM90 tests or a benchmark for an H200, and
collect a device run's results."""

import argparse

from .. import envmgr, gpu, gpu_engine, gpu_stage, runner
from ..errors import PatchsetError
from ..junit import read_node_list
from ..series import Series
from .options import Subparsers, chosen_base, command_parser, flag, path_option

HELP = (
    "stage the SM90 tests (--bench: a benchmark; --engine: vLLM itself) for "
    "an H200; --collect its results"
)


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
    flag(
        parser,
        "--engine",
        "stage vLLM itself, pristine and patched, in parts of one call each "
        "(SM90-only extensions, FlashInfer's SM90 MLA, the cp312 wheels the "
        "machine lacks) and upstream's glm5next step to run on both",
    )
    path_option(
        parser, "--collect", "copy a device run's $OUT into build/gpu/results-<V>"
    )


def run(args: argparse.Namespace) -> int:
    base = chosen_base(args)
    if args.collect:
        report = gpu.collect(
            args.collect,
            gpu_stage.results_dir(base),
            read_node_list(base.expected_base_failures),
        )
        print(report)
        return 1 if "departures:" in report else 0
    if args.engine and args.bench:
        raise PatchsetError("--engine and --bench stage different things: name one")
    envmgr.setup(base)
    runner.ensure_patched_tree(base)
    if args.engine:
        print(gpu_engine.stage_engine(Series.load(base)))
    elif args.bench == "quant":
        print(gpu_stage.stage_quant_bench(base))
    else:
        print(gpu_stage.stage_tests(Series.load(base), bench=bool(args.bench)))
    return 0
