#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mutation check of patch 0002's rule: each mutation must fail a test.

Usage: python benchmarks/mutate_0002.py CHECKOUT [--only N ...] [--out FILE]

CHECKOUT is a git checkout of vLLM 0.34.0 with the series applied and its
compiled extensions linked, such as a `cp -a` of
build/0.34.0/test-checkout-patched re-applied with the current patches (never
that folder itself: the test command resets it). Mutation 0 is none (the
baseline). Each mutation replaces one text, which must occur exactly once,
runs the two test files of the rule from CHECKOUT/tests as the test command's
emulated SM90 host part does (and, for config.py, on the plain CPU host too),
and restores the file with `git checkout`. One line of JSON per run goes to
stdout and to --out; `killed_by` is the failed tests less those the base's
expected-sm90-failures.txt / expected-cpu-failures.txt list (they fail on
that host with or without the series).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from patchset_tool import bases, envmgr, paths, sourcetree  # noqa: E402
from patchset_tool.junit import read_node_list  # noqa: E402

TESTS = [
    "models/glm5next/test_fp8_kv_cache.py",
    "v1/attention/test_flashmla_nope_sm90_backend_selection.py",
]
CUDA = "vllm/platforms/cuda.py"
SPARSE = "vllm/v1/attention/backends/mla/flashmla_sparse.py"
MLA = "vllm/model_executor/layers/attention/mla_attention.py"
CONFIG = "vllm/model_executor/models/config.py"
DTYPES_512 = '(None, "auto", "bfloat16", "float16", "fp8", "fp8_ds_mla")'
WARNING = (
    "            if (\n"
    '                self.attn_backend.get_name() == "FLASHMLA_SPARSE"\n'
    "                and self.head_size == 512\n"
    '                and kv_cache_dtype == "fp8"\n'
    "            ):\n"
    "                # FLASHMLA_SPARSE takes head size 512 on SM90 only.\n"
    "                logger.warning_once(_NOPE_FP8_IS_FP8_DS_MLA)\n"
)
SM90_TEST = "            and current_platform.is_device_capability_family(90)"
BACKENDS = "(vllm_config.attention_config.backend, spec_config.attention_backend)"
DRAFTERS_WITH_A_CACHE = "spec_config is None or not spec_config.uses_draft_kv_cache()"
SUPPORTS = 'not backend.get_class().supports_kv_cache_dtype("fp8_ds_mla")'

# (file, old text, new text): 1-13 from the brief, 14- the branches it missed.
MUTATIONS: dict[int, tuple[str, str, str]] = {
    1: (CUDA, ' and kv_cache_dtype != "fp8":', ":"),
    2: (CUDA, 'kv_cache_dtype != "fp8":', 'kv_cache_dtype == "fp8":'),
    3: (SPARSE, DTYPES_512, '(None, "auto", "bfloat16", "float16", "fp8_ds_mla")'),
    4: (SPARSE, DTYPES_512, DTYPES_512[:-1] + ', "fp8_e4m3")'),
    5: (MLA, WARNING, ""),
    6: (MLA, "and self.head_size == 512\n", "and self.head_size == 576\n"),
    7: (CONFIG, "current_platform.is_device_capability_family(90)\n", "True\n"),
    8: (CONFIG, 'spec_config.method != "mtp"', 'spec_config.method == "mtp"'),
    9: (
        CONFIG,
        "        if spec_config.kv_cache_dtype is None:\n            spec_config.kv",
        "        if True:\n            spec_config.kv",
    ),
    10: (CONFIG, "if spec_config.kv_cache_dtype is not None or any(", "if any("),
    11: (CONFIG, BACKENDS, "(spec_config.attention_backend,)"),
    12: (CONFIG, SUPPORTS, "True"),
    13: (CONFIG, "_keep_drafter_fp8_rows(vllm_config)\n            return", "return"),
    14: (
        CONFIG,
        'cache_config.cache_dtype == "fp8"\n            and current_platform.is_cuda',
        "current_platform.is_cuda",
    ),
    15: (CONFIG, 'if spec_config.kv_cache_dtype == "fp8":', "if False:"),
    16: (CONFIG, SUPPORTS, "False"),
    17: (
        CONFIG,
        "fp8_rows(vllm_config)\n            return",
        "fp8_rows(vllm_config)\n            pass",
    ),
    18: (
        CONFIG,
        f"if {DRAFTERS_WITH_A_CACHE}:\n        return\n    if spec",
        "if spec",
    ),
    19: (
        CUDA,
        'if head_size == 512 and kv_cache_dtype != "fp8":',
        'if kv_cache_dtype != "fp8":',
    ),
    20: (MLA, '512\n                and kv_cache_dtype == "fp8"\n', "512\n"),
    21: (
        MLA,
        'self.attn_backend.get_name() == "FLASHMLA_SPARSE"\n                and ',
        "",
    ),
    22: (
        CONFIG,
        "and current_platform.is_cuda()\n" + SM90_TEST,
        SM90_TEST.lstrip(),
    ),
    23: (
        CONFIG,
        'kv_cache_dtype = "fp8_e4m3"\n        return',
        'kv_cache_dtype = "fp8"\n        return',
    ),
    24: (CONFIG, DRAFTERS_WITH_A_CACHE, "spec_config is None"),
    25: (
        MLA,
        '"FLASHMLA_SPARSE"\n                and self.head_size == 512\n',
        '"FLASHMLA_SPARSE"\n',
    ),
}
SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def run_tests(checkout: Path, base: bases.Base, sm90: bool) -> dict:
    python = envmgr.setup(base)
    env = sourcetree.checkout_env(python, base, checkout, "mutation")
    env["PYTHONPATH"] += os.pathsep + str(paths.SUITE)
    command = [str(python), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    if sm90:
        env["GLM5NEXT_SM90_GPU_ONLY"] = str(base.expected_sm90_skips)
        command += ["-p", "glm5next_sm90_host"]
    start = time.monotonic()
    done = subprocess.run(
        [*command, *TESTS],
        cwd=checkout / "tests",
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    tail = done.stdout.strip().splitlines()[-1:] or [done.stderr[-300:]]
    failed = {f"tests/{m[1]}" for m in SUMMARY.findall(done.stdout)}
    # What fails on this host with or without the series is no kill.
    expected = base.expected_sm90_failures if sm90 else base.expected_cpu_failures
    return {
        "host": "emulated SM90" if sm90 else "CPU",
        "rc": done.returncode,
        "seconds": round(time.monotonic() - start),
        "counts": {k: int(n) for n, k in COUNTS.findall(tail[0])},
        "failed": sorted(failed),
        "killed_by": sorted(failed - read_node_list(expected)),
        "tail": tail[0],
    }


def mutate(checkout: Path, number: int) -> tuple[str, int]:
    """Apply mutation `number`; return its file and the line of the change."""
    rel, old, new = MUTATIONS[number]
    path = checkout / rel
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutation {number}: {old!r} occurs {text.count(old)}x")
    changed = text.index(old) + len(os.path.commonprefix([old, new]))
    line = text[:changed].count("\n") + 1
    path.write_text(text.replace(old, new))
    return rel, line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--only", type=int, nargs="*", default=[0, *MUTATIONS])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    base = bases.get_base("0.34.0")
    if checkout.parent == base.build_dir().resolve():
        raise SystemExit("refusing the test command's own checkout: copy it")
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if dirty:
        raise SystemExit(f"{checkout} has tracked changes:\n{dirty}")
    for number in args.only:
        rel, line = mutate(checkout, number) if number else ("-", 0)
        try:
            hosts = [True, False] if number == 0 or rel == CONFIG else [True]
            for sm90 in hosts:
                result = {"mutation": number, "at": f"{rel}:{line}"}
                result |= run_tests(checkout, base, sm90)
                print(json.dumps(result), flush=True)
                if args.out:
                    with args.out.open("a") as out:
                        out.write(json.dumps(result) + "\n")
        finally:
            if number:
                subprocess.run(["git", "checkout", "--", rel], cwd=checkout, check=True)


if __name__ == "__main__":
    main()
