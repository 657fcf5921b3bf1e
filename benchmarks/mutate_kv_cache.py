#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Mutation check of patches 0002 and 0003: each mutation must fail a test.

Usage: python benchmarks/mutate_kv_cache.py CHECKOUT [--only N ...] [--out FILE]

CHECKOUT is a git checkout of vLLM 0.34.0 with the series applied and its
compiled extensions linked, such as a `cp -a` of
build/0.34.0/test-checkout-patched re-applied with the current patches (never
that folder itself: the test command resets it). Mutation 0 is none (the
baseline). Each mutation replaces one text, which must occur exactly once,
runs the three test files of the rules from CHECKOUT/tests as the test command's
emulated SM90 host part does (the baseline on the plain CPU host too), and
restores the file with `git checkout`. One line of JSON per run goes to
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

from patchset_tool import bases, envmgr, sourcetree  # noqa: E402
from patchset_tool.junit import read_node_list  # noqa: E402

TESTS = [
    "config/test_draft_kv_cache_dtype.py",
    "models/glm5next/test_fp8_kv_cache.py",
    "v1/attention/test_flashmla_nope_sm90_backend_selection.py",
]
CUDA = "vllm/platforms/cuda.py"
SPARSE = "vllm/v1/attention/backends/mla/flashmla_sparse.py"
MLA = "vllm/model_executor/layers/attention/mla_attention.py"
QUANTIZED = "kv_cache_dtype is not None and is_quantized_kv_cache(kv_cache_dtype)"
NAMED_FLASHMLA = 'self.attn_backend.get_name() == "FLASHMLA_SPARSE"\n'
DRAFT_IF = "        if normalized_kv_cache_dtype != kv_cache_dtype:\n"
DRAFT_CALL = DRAFT_IF + "            _keep_draft_kv_cache_dtype(kv_cache_dtype)\n"
DRAFT_FIRST = "        _keep_draft_kv_cache_dtype(kv_cache_dtype)\n" + DRAFT_IF
MTP_BACKEND = (
    'backend.get_class().supports_kv_cache_dtype(\n        "fp8_ds_mla"\n    )'
)

# (file, old text, new text): patch 0003 (1-12, 19), then patch 0002 (13-18);
# 2, upstream's head-size test of the order the patch extends, was taken out.
MUTATIONS: dict[int, tuple[str, str, str]] = {
    1: (CUDA, f" and not (\n                {QUANTIZED}\n            ):", ":"),
    3: (SPARSE, '        "fp8_e4m3",  # alias', "        # alias"),
    4: (SPARSE, "            if device_capability.major == 9:", "            if True:"),
    5: (SPARSE, "and (reason := _mtp_drafter", "and False and (reason := _mtp_drafter"),
    6: (SPARSE, '                    and kv_cache_dtype != "fp8_ds_mla"\n', ""),
    7: (SPARSE, 'spec.method != "mtp"', 'spec.method == "mtp"'),
    8: (SPARSE, MTP_BACKEND, "False"),
    9: (SPARSE, 'if spec.kv_cache_dtype not in (None, "fp8_ds_mla"):', "if False:"),
    10: (SPARSE, '        elif kv_cache_dtype == "fp8_e4m3":', "        elif False:"),
    11: (
        MLA,
        '                logger.warning_once(\n                    "--kv',
        '                (\n                    "--kv',
    ),
    12: (MLA, "and self.head_size == 512\n            ):", "and True\n            ):"),
    13: (MLA, "            _keep_draft_kv_cache_dtype(kv_cache_dtype)\n", ""),
    14: (MLA, "        and spec.kv_cache_dtype is None\n", ""),
    15: (MLA, "        spec is not None\n        and", "        True\n        and"),
    16: (MLA, "        and not spec.draft_model_config.use_mla\n", ""),
    17: (MLA, "        and spec.draft_model_config is not None\n", ""),
    18: (MLA, DRAFT_CALL, DRAFT_FIRST),
    19: (
        MLA,
        NAMED_FLASHMLA + "                and self.head_size",
        "self.head_size",
    ),
}
SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def run_tests(checkout: Path, base: bases.Base, sm90: bool) -> dict:
    python = envmgr.setup(base)
    env = sourcetree.checkout_env(python, base, checkout, "mutation")
    command = [str(python), "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    command += sourcetree.cpu_host_plugin(env)
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
            hosts = [True, False] if number == 0 else [True]
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
