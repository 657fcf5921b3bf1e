# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5.3-Flash in vLLM's engine on one GPU: every KV-cache path, pristine
and patched, with dummy weights.

Runs on the GPU machine over the stage `scripts/patchset gpu --engine`
builds, once every part is unpacked (PART is the last part's folder):

    python3 benchmarks/bench_glm5_engine.py --stage PART --phase capacity
    python3 benchmarks/bench_glm5_engine.py --stage PART --phase perf \\
        --paths fp8,auto --trees patched --reps 3

Each configuration (tree, KV path, MTP, geometry) starts in a process of
its own on its tree (`engine.py run TREE -- python3 THIS child JSON`); the
parent keeps its output in `$OUT/engine.log`, one JSON line per run in
`$OUT/results.jsonl` and prints a table.

Geometries (config.json written from the suite's GLM-5.3-Flash config):

* `tp8`: one TP8 rank on one GPU. All 45 layers and the MTP layer;
  attention heads (and KV heads), KDA heads, the dense MLP and the experts'
  intermediate size divided by 8, as tensor parallelism shards them, so a
  rank's MLA rows and KDA state are a real rank's. Differs from a real rank:
  `--experts` routed experts instead of 288 (weights to fit 80 GB), the
  vocabulary whole (a rank holds 1/8 of embedding and LM head), no
  all-reduce.
* `small`: layers 0-3 (three KDA, one sparse MLA) with the TP8 heads, 16
  experts, for quick start checks.

Every engine: `load_format="dummy"`, mHC on (the config's `mhc: true`),
`max_model_len` 32768, prefix caching off (every timed prompt is
prefilled), the KV cache fixed with `kv_cache_memory_bytes` so the paths
compare at equal memory, FlashInfer autotune off (`--disable-flashinfer-
autotune`: the stage's FlashInfer holds the SM90 MLA modules alone, and no
op this model runs on SM90 is one FlashInfer's autotuner tunes), MTP with
one speculative token unless `--no-mtp`.

Phases:

* `capacity`: eager starts; per run the backend and cache dtype of every
  target and drafter layer (from the worker), "Model loading took",
  "KV cache size" and "Maximum concurrency for 32,768 tokens".
* `perf`: CUDA graphs on (capture sizes up to 2 x 64; `--eager`: off); the
  measurement of `vllm bench latency` through `vllm.LLM` (random token
  ids, temperature 1.0, `ignore_eos`): at concurrency 1, 16 and 64 the
  latency of a batch with 1 output token (TTFT) and with `--out` tokens;
  TPOT = (L_out - L_1) / (out - 1), output throughput = concurrency x out
  / L_out, and MTP's acceptance from the engine's spec-decode counters
  over the timed runs. `--reps` repetitions, the concurrencies interleaved
  within a repetition.
* `quant`: patch 0001 in the engine: BF16 dummy weights with
  `--quantization online` and a `targets` regex (`--targets`), eager, no
  MTP; the "Quantizing N layers" line.
* `proxy`: an accuracy proxy: teacher-forced top-20 prompt logprobs of the
  same prompts under each path (same dummy weights: vLLM seeds them);
  the parent reports top-1 agreement and a KL estimate over the top 20
  against `auto`. Dummy weights make it a check of the KV paths' plumbing,
  not of model quality.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
CONFIG = HERE.parents[1] / "tests" / "models" / "glm5next" / "glm-5.3-flash-config.json"
PATHS = {
    "auto": {"kv_cache_dtype": "auto"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8+fi": {
        "kv_cache_dtype": "fp8",
        "attention_backend": "FLASHINFER_MLA_SPARSE_SM90",
    },
}
CONCURRENCY = (1, 16, 64)
MAX_MODEL_LEN = 32768
LOG_PATTERNS = {
    "load_gib": r"Model loading took ([\d.]+) GiB",
    "kv_tokens": r"KV cache size: ([\d,]+) tokens",
    "max_concurrency": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
    "available_kv_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "quantizing": r"Quantizing (\d+) layers",
    "max_num_batched_tokens": r"max_num_batched_tokens=(\d+)",
    "backends": r"Using (\w+) (?:attention )?backend",
}


def geometry(name: str, experts: int) -> dict:
    """GLM-5.3-Flash's config reshaped to `name` (see the module doc)."""
    config = json.loads(CONFIG.read_text())
    tp = 8
    for key in ("num_attention_heads", "num_key_value_heads"):
        config[key] //= tp
    config["linear_attn_config"]["num_heads"] //= tp
    config["intermediate_size"] //= tp
    config["moe_intermediate_size"] //= tp
    config["n_routed_experts"] = experts
    if name == "small":
        layers = 4
        config["n_routed_experts"] = 16
        config["num_hidden_layers"] = layers
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            config[key] = config[key][:layers]
        linear = config["linear_attn_config"]
        for key in ("kda_layers", "full_attn_layers"):
            linear[key] = [i for i in linear[key] if i < layers]
    return config


def engine_kwargs(spec: dict, model_dir: str) -> dict:
    kwargs = {
        "model": model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": False,
        "kv_cache_memory_bytes": int(spec["kv_gib"] * 2**30),
        "enable_flashinfer_autotune": False,
        "disable_log_stats": False,
        "seed": 0,
        **PATHS[spec["path"]],
    }
    if spec["mtp"]:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 1}
    if spec["phase"] == "perf" and not spec["eager"]:
        sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    else:
        kwargs["enforce_eager"] = True
    if spec["phase"] == "quant":
        kwargs["quantization"] = "online"
        kwargs["quantization_config"] = {"targets": {spec["targets"]: "mxfp8"}}
    return kwargs


def _worker_layers(worker) -> dict:
    """Runs in the worker: backend and cache dtype of every layer with a
    KV cache or state, counted by role (target, or MTP drafter: layer 45)."""
    import torch

    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    config = worker.vllm_config
    target_layers = config.model_config.hf_text_config.num_hidden_layers
    rows: dict[str, int] = {}
    for name, layer in get_layers_from_vllm_config(config, AttentionLayerBase).items():
        drafter = f".layers.{target_layers}." in f".{name}."
        dtype = getattr(layer, "kv_cache_dtype", "-")
        backend = layer.get_attn_backend().get_name()
        role = "drafter" if drafter else "target"
        key = f"{role} {type(layer).__name__} {backend} {dtype}"
        rows[key] = rows.get(key, 0) + 1
    return {
        "layers": rows,
        "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "gpu": torch.cuda.get_device_name(),
    }


def _spec_counts(llm) -> dict[str, float]:
    counts: dict[str, float] = {}
    for metric in llm.get_metrics():
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if metric.name == f"vllm:spec_decode_{key}":
                counts[key] = counts.get(key, 0.0) + float(getattr(metric, "value", 0))
    return counts


def _latency(llm, prompts, out_len: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(
        n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=out_len
    )
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def perf(llm, spec: dict) -> dict:
    import random

    rng = random.Random(0)

    def batch(size: int) -> list[dict]:
        return [
            {"prompt_token_ids": [rng.randrange(10000) for _ in range(spec["in"])]}
            for _ in range(size)
        ]

    _latency(llm, batch(4), 16)  # warm-up, as `vllm bench latency`
    before = _spec_counts(llm)
    runs = []
    for rep in range(spec["reps"]):
        for c in CONCURRENCY:
            first = _latency(llm, batch(c), 1)
            whole = _latency(llm, batch(c), spec["out"])
            runs.append(
                {
                    "rep": rep,
                    "concurrency": c,
                    "ttft_s": first,
                    "tpot_ms": 1000 * (whole - first) / (spec["out"] - 1),
                    "out_tok_s": c * spec["out"] / whole,
                }
            )
    after = _spec_counts(llm)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    accepted = None
    if delta.get("num_draft_tokens"):
        accepted = delta["num_accepted_tokens"] / delta["num_draft_tokens"]
    return {"runs": runs, "spec_decode": delta, "acceptance": accepted}


def proxy(llm) -> dict:
    """Top-20 prompt logprobs of fixed prompts, per position."""
    import random

    from vllm import SamplingParams

    rng = random.Random(1)
    prompts = [
        {"prompt_token_ids": [rng.randrange(10000) for _ in range(512)]}
        for _ in range(4)
    ]
    params = SamplingParams(max_tokens=1, prompt_logprobs=20, temperature=0.0)
    out = []
    for request in llm.generate(prompts, params, use_tqdm=False):
        rows = []
        for position in request.prompt_logprobs[1:]:
            rows.append({str(t): lp.logprob for t, lp in position.items()})
        out.append(rows)
    return {"prompt_logprobs": out}


def child(spec: dict) -> None:
    """One engine, in this process (run on one tree by `engine.py run`)."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    result = {"spec": spec}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        config = geometry(spec["geometry"], spec["experts"])
        (model / "config.json").write_text(json.dumps(config))
        started = time.perf_counter()
        llm = LLM(**engine_kwargs(spec, str(model)))
        result["start_s"] = time.perf_counter() - started
        try:
            result.update(llm.collective_rpc(_worker_layers)[0])
        except Exception as error:  # the log still has the backends
            result["layers_error"] = repr(error)
        if spec["phase"] == "perf":
            result.update(perf(llm, spec))
        print("RESULT " + json.dumps(result), flush=True)
        if spec["phase"] == "proxy":
            print("RESULT " + json.dumps({**result, **proxy(llm)}), flush=True)


def run_one(spec: dict, stage: Path, out: Path, timeout_s: int) -> dict:
    """`spec` on its tree in a fresh process, its output appended to
    `out/engine.log` as it comes; the child's result plus what its log
    says, appended to `out/results.jsonl`."""
    cmd = [
        sys.executable, str(stage / "engine.py"), "run", spec["tree"], "--",
        sys.executable, str(HERE), "child", json.dumps(spec),
    ]  # fmt: skip
    started = time.time()
    log_path = out / "engine.log"
    with open(log_path, "a") as log:
        log.write(f"\n===== {json.dumps(spec)}\n")
        log.flush()
        offset = log.tell()
        # Its own session, so a timeout also ends the engine core it started
        # (left running, it would hold the GPU's memory for the next run).
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
    with open(log_path, errors="replace") as log:
        log.seek(offset)
        text = log.read()
    lines = text.splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    row = results[-1] if results else {"spec": spec}
    row["rc"], row["wall_s"] = rc, round(time.time() - started, 1)
    for key, pattern in LOG_PATTERNS.items():
        found = re.findall(pattern, text)
        if found:
            last = found[-1].replace(",", "")
            row[key] = ",".join(sorted(set(found))) if key == "backends" else last
    if rc:
        # The root cause: the first exception line, not the engine's summary.
        errors = [line for line in lines if re.search(r"^\S*(Error|Exception): ", line)]
        errors += [line for line in lines if re.search(r"\w(Error|Exception): ", line)]
        row["error"] = errors[0][-300:] if errors else text[-300:]
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def summary_line(row: dict) -> str:
    spec = row["spec"]
    head = (
        f"{spec['tree']:8} {spec['path']:8} mtp={int(spec['mtp'])} "
        f"{spec['geometry']} rc={row['rc']} {row['wall_s']}s"
    )
    if row["rc"]:
        return f"{head} ERROR {row.get('error', '')}"
    parts = [head]
    for key in ("load_gib", "kv_tokens", "max_concurrency", "quantizing"):
        if key in row:
            parts.append(f"{key}={row[key]}")
    for layer, count in sorted(row.get("layers", {}).items()):
        parts.append(f"\n    {count:3} x {layer}")
    for r in row.get("runs", []):
        parts.append(
            f"\n    rep{r['rep']} c={r['concurrency']:2} ttft={r['ttft_s']:.3f}s "
            f"tpot={r['tpot_ms']:.2f}ms out={r['out_tok_s']:.0f}tok/s"
        )
    if row.get("acceptance") is not None:
        parts.append(f"\n    MTP acceptance {row['acceptance']:.3f}")
    return " ".join(parts)


def proxy_report(rows: list[dict]) -> list[str]:
    """Each path's prompt logprobs against `auto`'s on the same tree: top-1
    agreement, and KL(auto || path) over `auto`'s top 20 tokens (a token
    missing from the path's top 20 gets the path's 20th logprob)."""
    import math

    lines = []
    refs = {
        r["spec"]["tree"]: r["prompt_logprobs"]
        for r in rows
        if r.get("prompt_logprobs") and r["spec"]["path"] == "auto"
    }
    for row in rows:
        ref = refs.get(row.get("spec", {}).get("tree"))
        if not ref or not row.get("prompt_logprobs") or row["spec"]["path"] == "auto":
            continue
        same = total = 0
        kl = 0.0
        for want, got in zip(ref, row["prompt_logprobs"]):
            for p, q in zip(want, got):
                total += 1
                same += max(p, key=p.get) == max(q, key=q.get)
                floor = min(q.values())
                kl += sum(math.exp(lp) * (lp - q.get(t, floor)) for t, lp in p.items())
        spec = row["spec"]
        lines.append(
            f"proxy {spec['tree']} {spec['path']} vs auto: top-1 agreement "
            f"{same / total:.4f}, KL estimate {kl / total:.3e} over {total} positions"
        )
    return lines


def main(argv: list[str]) -> int:
    if argv[:1] == ["child"]:
        child(json.loads(argv[1]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=Path, required=True, help="the last part")
    parser.add_argument(
        "--phase", choices=("capacity", "perf", "quant", "proxy"), default="capacity"
    )
    parser.add_argument("--paths", default="auto,fp8,fp8_e4m3,fp8+fi")
    parser.add_argument("--trees", default="pristine,patched")
    parser.add_argument("--geometry", choices=("tp8", "small"), default="tp8")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--kv-gib", type=float, default=40.0)
    parser.add_argument("--no-mtp", action="store_true")
    parser.add_argument("--eager", action="store_true", help="perf without graphs")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--in", dest="in_len", type=int, default=2048)
    parser.add_argument("--out", dest="out_len", type=int, default=256)
    parser.add_argument("--targets", default="", help="regex, for --phase quant")
    parser.add_argument("--rounds", type=int, default=1, help="restarts, interleaved")
    parser.add_argument("--timeout", type=int, default=300, help="per engine, s")
    parser.add_argument("--budget", type=int, default=540, help="no start after, s")
    args = parser.parse_args(argv)
    unknown = set(args.paths.split(",")) - set(PATHS)
    if unknown:
        parser.error(f"unknown path(s) {', '.join(sorted(unknown))}")
    out = Path(os.environ.get("OUT", "/tmp/glm5engine-out"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    started = time.time()
    runs = [
        (tree, path)
        for _ in range(args.rounds)
        for path in args.paths.split(",")
        for tree in args.trees.split(",")
    ]
    for tree, path in runs:
        if time.time() - started > args.budget:
            print(f"budget of {args.budget} s spent: {tree} {path} not run")
            rows.append({"rc": "not run"})
            continue
        spec = {
            "tree": tree, "path": path, "phase": args.phase,
            "geometry": args.geometry, "experts": args.experts,
            "kv_gib": args.kv_gib, "mtp": not args.no_mtp, "reps": args.reps,
            "eager": args.eager,
            "in": args.in_len, "out": args.out_len, "targets": args.targets,
        }  # fmt: skip
        row = run_one(spec, args.stage.resolve(), out, args.timeout)
        print(summary_line(row), flush=True)
        rows.append(row)
    for line in proxy_report(rows):
        print(line, flush=True)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
