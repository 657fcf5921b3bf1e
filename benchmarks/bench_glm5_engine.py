# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""GLM-5.3-Flash in vLLM's engine on one GPU: every KV-cache path, pristine
and patched, with dummy weights; and the engine starts of patches 0001 and
0002.

Runs on the GPU machine over the stage `scripts/patchset gpu --engine`
builds, once every part is unpacked (PART is the last part's folder; a call
on the same warm machine need not carry it again):

    python3 benchmarks/bench_glm5_engine.py --stage PART --phase perf \\
        --paths fp8,fp8+fi,auto --trees patched --gpu-memory-utilization 0.9
    python3 benchmarks/bench_glm5_engine.py --summarize results.jsonl

Each configuration (tree, KV path, MTP, geometry, capacity) starts in a
process of its own on its tree (`engine.py run TREE -- python3 THIS child
JSON`): one that dies (a CUDA OOM, a refused config) costs only its row,
which records its exit status, the root cause (the first exception line)
and the last error line, and the parent goes on. The children's output goes
to `$OUT/engine.log`; one JSON line per configuration is appended to
`--results` (default `$OUT/results.jsonl`), with the stage's series id and
vLLM version (`series`, `base`: the part's `MANIFEST.json`), the GPU
(`gpu`: nvidia-smi's name and driver; `cuda_device`: the worker's torch)
and the UTC time; a summary is printed at the end. `--summarize FILE`
prints it again from such a file (no GPU needed).

Time: `--budget` is the call's length (default 570 s, inside a 600 s device
call; several commands in one call share it out). An engine gets
`--timeout` (default 480 s: a fresh machine's first FLASHMLA_SPARSE start
spends ~306 s in vLLM's JIT kernel warm-up, which eager engines skip) or
what is left of the budget, if less; none starts with less than 90 s left
(its row says "not run").

JIT caches: `--jit-cache FILE` (a tgz this script wrote) is extracted
before the first engine, if FILE exists (carry it in an ignored folder).
After the call's first engine and at the end (also after a failure or
SIGTERM) `$OUT/jit-cache.tgz` is written afresh, at most 14 MiB (the
folders that fit, in this order; the size is printed): TileLang's
`~/.tilelang/cache`, each tree's `VLLM_CACHE_ROOT` (`engine.py` sets
ENGINE_ROOT/cache-TREE: torch.compile's artifacts and the Triton kernels
built once it has run), Triton's `~/.triton/cache`, FlashInfer's
`~/.cache/flashinfer` and workspaces (ENGINE_ROOT/fiws-TREE).

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
prefilled), FlashInfer autotune off (`--disable-flashinfer-autotune`: the
stage's FlashInfer holds the SM90 MLA modules alone, and no op this model
runs on SM90 is one FlashInfer's autotuner tunes), MTP with one speculative
token unless `--no-mtp`. Capacity: the KV cache fixed with
`kv_cache_memory_bytes` (`--kv-gib`, default 40), so the paths compare at
equal KV memory, or `--gpu-memory-utilization U` (no fixed size; what the
profile leaves); rows record which, "KV cache size" (tokens) and
"Available KV cache memory". CUDA graphs (capture sizes 1 to 128) in
`capacity` and `perf` unless `--eager`; the other phases run eager.

Phases:

* `capacity`: per start the backend and cache dtype of every target and
  drafter layer (from the worker), "Model loading took", "KV cache size",
  "Maximum concurrency for 32,768 tokens"; with `--shapes`, that load once
  per repetition (as `perf`), so a start that dies on its first large step
  says so.
* `perf`: the measurement of `vllm bench latency` through `vllm.LLM`
  (random token ids, temperature 1.0, `ignore_eos`). `--shapes IN:C,C...`
  (default `2048:1,16,64 8192:4,16`; `--in N` is `N:1,16,64`): for each
  prompt length IN and concurrency C the latency of a batch with 1 output
  token (TTFT) and with `--out` tokens (default 128); TPOT = (L_out - L_1)
  / (out - 1), output throughput = C x out / L_out, and MTP's acceptance
  from the engine's spec-decode counters over the timed runs. `--reps`
  repetitions, the shapes interleaved within one. The summary gives per
  tree, path, capacity and shape the mean and the spread ((max - min) /
  mean) over the repetitions, a spread over 10% marked `!`.
* `quant`: patch 0001 in the engine: BF16 dummy weights with
  `--quantization online` and `{"targets": {TARGETS: SCHEME}}` (`--targets`:
  a regex key, or `non-kda-128` / `all-196`, the "Layer coverage" regexes
  of docs/measurements.md; `--scheme`, default `fp8_per_channel`: Hopper
  has no MXFP8), no MTP; the "Quantizing N layers" line, the linear kernels
  selected and the token ids greedy decoding makes of a fixed prompt (no
  tokenizer: ids only).
* `spec-repro`: patch 0002's case: a DeepSeek-V3.2-shaped target (the
  verification matrix's config: 64 heads, 512 + 64 latent, the 64 x 128
  indexer with index_topk 2048; two layers, both dense) with a one-layer
  Llama draft model (`method: draft_model`, the same vocabulary), under
  `--paths fp8` on SM90. Per tree: whether the engine started, else its
  error, and the backend and cache dtype of the target's and the drafter's
  layers, and the ids of a greedy generation.
* `proxy`: an accuracy proxy: teacher-forced top-20 prompt logprobs of the
  same prompts under each path (same dummy weights: vLLM seeds them);
  the parent reports top-1 agreement and a KL estimate over the top 20
  against `auto`. Dummy weights make it a check of the KV paths' plumbing,
  not of model quality.
"""

import argparse
import contextlib
import gzip
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SUITE = HERE.parents[1] / "tests" / "models" / "glm5next"
CONFIG = SUITE / "glm-5.3-flash-config.json"
ENGINE_ROOT = Path(os.environ.get("GLM5ENGINE_ROOT", "/tmp/glm5engine"))  # engine.py's
PATHS = {
    "auto": {"kv_cache_dtype": "auto"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    # The release's opt-in to FlashMLA's rows: on the pristine tree, the
    # series' fp8 path without its FlashMLA sparse fixes.
    "fp8_ds_mla": {"kv_cache_dtype": "fp8_ds_mla"},
    "fp8+fi": {
        "kv_cache_dtype": "fp8",
        "attention_backend": "FLASHINFER_MLA_SPARSE_SM90",
    },
}
PHASES = ("capacity", "perf", "quant", "spec-repro", "proxy")
DEFAULT_SHAPES = ["2048:1,16,64", "8192:4,16"]
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
MAX_MODEL_LEN = 32768
MIN_START_S = 90
JIT_CACHE_MAX = 14 * 2**20
JIT_CACHES = [
    ("home", ".tilelang/cache"),
    ("engine", "cache-patched"),
    ("engine", "cache-pristine"),
    ("home", ".triton/cache"),
    ("home", ".cache/flashinfer"),
    ("engine", "fiws-patched"),
    ("engine", "fiws-pristine"),
]
"""(root, folder) in the order they are kept when the tgz must shrink."""

# docs/measurements.md, "Layer coverage"
_LAYERS = "([0-9]|[1-3][0-9]|4[0-4])"
_MLA_LAYERS = "(3|7|11|15|19|23|27|31|35|39|43)"
_SHARED = "mlp[.]shared_experts[.](gate_proj|up_proj|gate_up_proj|down_proj)"
_MLA = "o_proj|fused_qkv_a_proj|q_b_proj|indexer[.]wq_b"
_ATTN = f"self_attn[.](in_proj_qkvbfg_a|{_MLA})"
TARGETS = {
    "all-196": f"re:.*[.]layers[.]{_LAYERS}[.]({_ATTN}|{_SHARED})",
    "non-kda-128": (
        f"re:.*[.]layers[.]({_MLA_LAYERS}[.]self_attn[.]({_MLA})|{_LAYERS}[.]{_SHARED})"
    ),
}
LOG_PATTERNS = {
    "load_gib": r"Model loading took ([\d.]+) GiB",
    "kv_tokens": r"KV cache size: ([\d,]+) tokens",
    "max_concurrency": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
    "available_kv_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "graphs": r"Graph capturing finished in (\d+ secs, took [\d.]+ GiB)",
    "quantizing": r"Quantizing (\d+) layers",
    "quantized_types": r"Quantizing \d+ layers of types: (.*)",
    "max_num_batched_tokens": r"max_num_batched_tokens=(\d+)",
    "backends": r"Using (\w+) (?:attention )?backend",
    "kernels": r"Selected (\w+ for \w+)",
}
SETS = ("backends", "kernels")
SHOWN = ("wall_s", "start_s", "load_gib", "kv_tokens", "available_kv_gib", "quantizing")


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


def spec_repro_configs() -> tuple[dict, dict]:
    """Patch 0002's case: the verification matrix's DeepSeek-V3.2 target
    with both layers dense (no MoE kernel in the way) and its one-layer
    Llama drafter on the target's vocabulary."""
    sys.path.insert(0, str(SUITE))
    import fp8_kv_cache_matrix as matrix

    target = matrix.deepseek_v32_config() | {"first_k_dense_replace": 2}
    draft = matrix.llama_draft_config("LlamaForCausalLM")
    draft.pop("draft_vocab_size")
    return target, draft | {"vocab_size": target["vocab_size"]}


def write_models(spec: dict, tmp: Path) -> tuple[str, str | None]:
    """The config-only model folder(s) of `spec`: (target, drafter)."""
    if spec["phase"] == "spec-repro":
        configs = dict(zip(("model", "draft"), spec_repro_configs()))
    else:
        configs = {"model": geometry(spec["geometry"], spec["experts"])}
    for name, config in configs.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
    return str(tmp / "model"), str(tmp / "draft") if "draft" in configs else None


def engine_kwargs(spec: dict, model_dir: str, draft_dir: str | None = None) -> dict:
    kwargs = {
        "model": model_dir,
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": MAX_MODEL_LEN,
        "enable_prefix_caching": False,
        "enable_flashinfer_autotune": False,
        "disable_log_stats": False,
        "seed": 0,
        **PATHS[spec["path"]],
    }
    if spec["kv_gib"] is not None:
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_gib"] * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = spec["gpu_util"]
    if draft_dir is not None:
        kwargs["speculative_config"] = {
            "method": "draft_model",
            "model": draft_dir,
            "num_speculative_tokens": 1,
        }
    elif spec["mtp"]:
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 1}
    if spec["eager"]:
        kwargs["enforce_eager"] = True
    else:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": CAPTURE_SIZES}
    if spec["phase"] == "quant":
        kwargs["quantization"] = "online"
        kwargs["quantization_config"] = {"targets": {spec["targets"]: spec["scheme"]}}
    return kwargs


def _worker_layers(worker) -> dict:
    """Runs in the worker: backend and cache dtype of every layer with a
    KV cache or state, counted by role (target, or drafter: MTP's layer 45,
    or any layer the speculator marked as its own)."""
    import torch

    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    config = worker.vllm_config
    target_layers = config.model_config.hf_text_config.num_hidden_layers
    rows: dict[str, int] = {}
    layers = get_layers_from_vllm_config(config, AttentionLayerBase)  # type: ignore[type-abstract]
    for name, layer in layers.items():
        drafter = getattr(layer, "is_draft_layer", False)
        drafter = drafter or f".layers.{target_layers}." in f".{name}."
        dtype = getattr(layer, "kv_cache_dtype", "-")
        backend = layer.get_attn_backend().get_name()
        role = "drafter" if drafter else "target"
        key = f"{role} {type(layer).__name__} {backend} {dtype}"
        rows[key] = rows.get(key, 0) + 1
    return {
        "layers": rows,
        "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "cuda_device": torch.cuda.get_device_name(),
    }


def _spec_counts(llm) -> dict[str, float]:
    counts: dict[str, float] = {}
    for metric in llm.get_metrics():
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if metric.name == f"vllm:spec_decode_{key}":
                counts[key] = counts.get(key, 0.0) + float(getattr(metric, "value", 0))
    return counts


def _acceptance(llm, before: dict[str, float]) -> dict:
    after = _spec_counts(llm)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    accepted = None
    if delta.get("num_draft_tokens"):
        accepted = delta["num_accepted_tokens"] / delta["num_draft_tokens"]
    return {"spec_decode": delta, "acceptance": accepted}


def _latency(llm, prompts, out_len: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(
        n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=out_len
    )
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def perf(llm, spec: dict) -> dict:
    rng = random.Random(0)

    def batch(size: int, in_len: int) -> list[dict]:
        return [
            {"prompt_token_ids": [rng.randrange(10000) for _ in range(in_len)]}
            for _ in range(size)
        ]

    _latency(
        llm, batch(4, spec["shapes"][0][0]), 16
    )  # warm-up, as `vllm bench latency`
    before = _spec_counts(llm)
    runs = []
    for rep in range(spec["reps"]):
        for in_len, concurrencies in spec["shapes"]:
            for c in concurrencies:
                first = _latency(llm, batch(c, in_len), 1)
                whole = _latency(llm, batch(c, in_len), spec["out"])
                runs.append(
                    {
                        "rep": rep,
                        "in": in_len,
                        "concurrency": c,
                        "ttft_s": first,
                        "tpot_ms": 1000 * (whole - first) / (spec["out"] - 1),
                        "out_tok_s": c * spec["out"] / whole,
                    }
                )
    return {"runs": runs, **_acceptance(llm, before)}


def generate(llm) -> dict:
    """Greedy ids of a fixed 64-token prompt (through the drafter too)."""
    from vllm import SamplingParams

    rng = random.Random(2)
    prompt = {"prompt_token_ids": [rng.randrange(10000) for _ in range(64)]}
    before = _spec_counts(llm)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )[0].outputs[0]
    return {"token_ids": list(out.token_ids), "text": out.text or None} | _acceptance(
        llm, before
    )


def proxy(llm) -> dict:
    """Top-20 prompt logprobs of fixed prompts, per position."""
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
    """One engine, in this process (run on one tree by `engine.py run`).
    Prints a RESULT line once started and again when done, so a row keeps
    what the start showed when the measurement dies."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        llm = LLM(**engine_kwargs(spec, *write_models(spec, Path(tmp))))
        result["start_s"] = round(time.perf_counter() - started, 1)
        try:
            result.update(llm.collective_rpc(_worker_layers)[0])
        except Exception as error:  # the log still has the backends
            result["layers_error"] = repr(error)
        print("RESULT " + json.dumps(result), flush=True)
        if spec["shapes"]:
            result.update(perf(llm, spec))
        if spec["phase"] in ("quant", "spec-repro"):
            result.update(generate(llm))
        if spec["phase"] == "proxy":
            result.update(proxy(llm))
        print("RESULT " + json.dumps(result), flush=True)


def _error_lines(lines: list[str]) -> tuple[str, str]:
    """The root cause (the first exception line, not the engine's summary)
    and the last error line."""
    first = [line for line in lines if re.search(r"^\S*(Error|Exception): ", line)]
    first += [line for line in lines if re.search(r"\w(Error|Exception): ", line)]
    last = [line for line in lines if re.search(r"\w(Error|Exception)(: |$)", line)]
    return (first[0] if first else "")[-300:], (last[-1] if last else "")[-300:]


def run_one(spec: dict, stage: Path, out: Path, timeout_s: float) -> dict:
    """`spec` on its tree in a fresh process, its output appended to
    `out/engine.log` as it comes; the child's result plus what its log
    says."""
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
        rc = 124
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also after a crash or SIGTERM: what is left of the session
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(log_path, errors="replace") as log:
        log.seek(offset)
        text = log.read()
    lines = text.splitlines()
    row: dict = {}
    for line in lines:
        if line.startswith("RESULT "):
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line[7:])
    row.update(rc=rc, wall_s=round(time.time() - started, 1), timeout_s=int(timeout_s))
    for key, pattern in LOG_PATTERNS.items():
        found = re.findall(pattern, text)
        if found:
            last = found[-1].replace(",", "") if key != "quantized_types" else found[-1]
            row[key] = ",".join(sorted(set(found))) if key in SETS else last
    if rc:
        row["error"], row["error_last"] = _error_lines(lines)
        if rc == 124:
            row["error"] = f"timed out after {timeout_s:.0f} s"
        row["error"] = row["error"] or text[-300:]
    return row


def _keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    ok = (info.isfile() or info.isdir()) and not info.name.endswith(".lock")
    return info if ok else None


def _write_tgz(dest: Path, folders: list[tuple[Path, str]]) -> list[int]:
    """`folders` (path, name in the archive) into `dest`; the compressed
    size after each."""
    marks = []
    with (
        open(dest, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for path, name in folders:
            tar.add(path, name, filter=_keep)
            marks.append(raw.tell())
    return marks


def save_jit_cache(dest: Path) -> str:
    """Write the JIT caches into `dest`: the longest head of JIT_CACHES
    whose tgz stays under JIT_CACHE_MAX."""
    roots = {"home": Path.home(), "engine": ENGINE_ROOT}
    found = [
        (roots[t] / r, f"{t}/{r}") for t, r in JIT_CACHES if (roots[t] / r).is_dir()
    ]
    tmp = dest.with_name(dest.name + ".tmp")
    marks = _write_tgz(tmp, found)
    if tmp.stat().st_size > JIT_CACHE_MAX:
        fits = sum(mark < JIT_CACHE_MAX - 2**20 for mark in marks)
        print(
            f"jit cache: {tmp.stat().st_size / 2**20:.1f} MiB, keeping {fits} folders"
        )
        found = found[:fits]
        _write_tgz(tmp, found)
    tmp.replace(dest)
    names = ", ".join(name for _, name in found) or "nothing"
    return f"jit cache: {dest} {dest.stat().st_size / 2**20:.2f} MiB ({names})"


def restore_jit_cache(src: Path) -> str:
    roots = {"home": Path.home(), "engine": ENGINE_ROOT}
    if not src.is_file():
        return f"jit cache: no {src}, starting cold"
    count = 0
    with tarfile.open(src) as tar:
        for member in tar.getmembers():
            top, _, rest = member.name.partition("/")
            if top in roots and rest:
                member.name = rest
                tar.extract(member, roots[top], filter="data")
                count += 1
    return f"jit cache: {count} entries restored from {src}"


def gpu_name() -> str:
    if not shutil.which("nvidia-smi"):
        return "unknown"
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "unknown"


def _capacity(spec: dict) -> str:
    if spec["kv_gib"] is not None:
        return f"kv={spec['kv_gib']:g}GiB"
    return f"util={spec['gpu_util']:g}"


def summary_line(row: dict) -> str:
    spec = row["spec"]
    head = (
        f"{spec['tree']:8} {spec['path']:8} {spec['phase']} mtp={int(spec['mtp'])} "
        f"{spec['geometry']} {_capacity(spec)} rc={row['rc']}"
    )
    parts = [head]
    for key in SHOWN:
        if key in row:
            parts.append(f"{key}={row[key]}")
    if row["rc"]:
        parts.append(f"\n    ERROR {row.get('error', '')}")
        if row.get("error_last") and row["error_last"] != row.get("error"):
            parts.append(f"\n    last: {row['error_last']}")
    for layer, count in sorted(row.get("layers", {}).items()):
        parts.append(f"\n    {count:3} x {layer}")
    if "token_ids" in row:
        parts.append(f"\n    tokens {row['token_ids']}")
    if row.get("acceptance") is not None:
        parts.append(f"\n    spec-decode acceptance {row['acceptance']:.3f}")
    return " ".join(parts)


def perf_table(rows: list[dict]) -> list[str]:
    """Mean and spread ((max - min) / mean) per tree, path, capacity and
    shape over every repetition (and restart) of `rows`."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        spec = row.get("spec", {})
        for r in row.get("runs", []):
            key = (
                spec["tree"],
                spec["path"],
                _capacity(spec),
                r["in"],
                r["concurrency"],
            )
            groups.setdefault(key, []).append(r)

    def cell(values: list[float], fmt: str) -> str:
        mean = sum(values) / len(values)
        spread = (max(values) - min(values)) / mean if mean else 0.0
        return f"{mean:{fmt}} ({spread:.0%}{'!' if spread > 0.10 else ''})"

    lines = [
        "| tree | path | capacity | in | c | n | TTFT s | TPOT ms | out tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, runs in sorted(groups.items()):
        cells = [
            cell([r["ttft_s"] for r in runs], ".3f"),
            cell([r["tpot_ms"] for r in runs], ".2f"),
            cell([r["out_tok_s"] for r in runs], ".0f"),
        ]
        lines.append(
            f"| {' | '.join(map(str, key))} | {len(runs)} | {' | '.join(cells)} |"
        )
    if not groups:
        return []
    return [*lines, "(mean (spread) over n runs; ! marks a spread over 10%)"]


def proxy_report(rows: list[dict]) -> list[str]:
    """Each path's prompt logprobs against `auto`'s on the same tree: top-1
    agreement, and KL(auto || path) over `auto`'s top 20 tokens (a token
    missing from the path's top 20 gets the path's 20th logprob)."""
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


def report(rows: list[dict]) -> None:
    for line in [*map(summary_line, rows), *perf_table(rows), *proxy_report(rows)]:
        print(line, flush=True)


def parse_shapes(items: list[str]) -> list[tuple[int, list[int]]]:
    """`IN:C,C,...` items: prompt length and its concurrencies."""
    shapes = []
    for item in items:
        in_len, _, concurrencies = item.partition(":")
        shapes.append((int(in_len), [int(c) for c in concurrencies.split(",")]))
    return shapes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=Path, help="the last part (its MANIFEST.json)")
    p.add_argument("--summarize", type=Path, help="print the summary of a JSONL")
    p.add_argument("--phase", choices=PHASES, default="capacity")
    p.add_argument("--paths", default="auto,fp8,fp8_e4m3,fp8+fi")
    p.add_argument("--trees", default="pristine,patched")
    p.add_argument("--geometry", choices=("tp8", "small"), default="tp8")
    p.add_argument("--experts", type=int, default=64)
    capacity = p.add_mutually_exclusive_group()
    capacity.add_argument("--kv-gib", type=float, default=40.0)
    capacity.add_argument("--gpu-memory-utilization", type=float, dest="gpu_util")
    p.add_argument("--no-mtp", action="store_true")
    p.add_argument("--eager", action="store_true", help="capacity/perf: no graphs")
    shapes = p.add_mutually_exclusive_group()
    shapes.add_argument("--shapes", nargs="+", metavar="IN:C,C")
    shapes.add_argument("--in", dest="in_len", type=int, help="IN:1,16,64")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", dest="out_len", type=int, default=128)
    p.add_argument("--targets", help="quant: a regex key, or " + "/".join(TARGETS))
    p.add_argument("--scheme", default="fp8_per_channel", help="quant: the scheme")
    p.add_argument("--rounds", type=int, default=1, help="restarts, interleaved")
    p.add_argument("--timeout", type=int, default=480, help="per engine, s")
    p.add_argument("--budget", type=int, default=570, help="the call's time, s")
    p.add_argument("--results", type=Path, help="default $OUT/results.jsonl")
    p.add_argument("--jit-cache", type=Path, help="a tgz to restore first")
    return p


def specs(args: argparse.Namespace, p: argparse.ArgumentParser) -> list[dict]:
    """The configurations to run, in order (rounds, paths, trees)."""
    unknown = set(args.paths.split(",")) - set(PATHS)
    if unknown:
        p.error(f"unknown path(s) {', '.join(sorted(unknown))}")
    if args.phase == "quant" and not args.targets:
        p.error("--phase quant needs --targets")
    try:
        items = args.shapes or ([f"{args.in_len}:1,16,64"] if args.in_len else None)
        if items is None and args.phase == "perf":
            items = DEFAULT_SHAPES
        shapes = parse_shapes(items or [])
    except ValueError:
        p.error("--shapes: IN:C,C,... items, e.g. 2048:1,16,64")
    if any(in_len + args.out_len > MAX_MODEL_LEN for in_len, _ in shapes):
        p.error(f"a prompt of --shapes plus --out exceeds {MAX_MODEL_LEN}")
    graphs = args.phase in ("capacity", "perf") and not args.eager
    common = {
        "phase": args.phase, "geometry": args.geometry, "experts": args.experts,
        "kv_gib": None if args.gpu_util else args.kv_gib, "gpu_util": args.gpu_util,
        "mtp": not args.no_mtp and args.phase not in ("quant", "spec-repro"),
        "eager": not graphs, "reps": args.reps, "shapes": shapes,
        "out": args.out_len, "scheme": args.scheme,
        "targets": TARGETS.get(args.targets, args.targets),
    }  # fmt: skip
    return [
        {"tree": tree, "path": path, **common}
        for _ in range(args.rounds)
        for path in args.paths.split(",")
        for tree in args.trees.split(",")
    ]


def main(argv: list[str]) -> int:
    if argv[:1] == ["child"]:
        child(json.loads(argv[1]))
        return 0
    p = parser()
    args = p.parse_args(argv)
    if args.summarize:
        report([json.loads(line) for line in args.summarize.read_text().splitlines()])
        return 0
    if args.stage is None:
        p.error("--stage is required (or --summarize)")
    runs = specs(args, p)
    stage = args.stage.resolve()
    out = Path(os.environ.get("OUT", "/tmp/glm5engine-out"))
    out.mkdir(parents=True, exist_ok=True)
    results = args.results or out / "results.jsonl"
    manifest = json.loads((stage / "MANIFEST.json").read_text())
    common = {
        "series": manifest.get("series"),
        "base": manifest.get("vllm"),
        "gpu": gpu_name(),
    }
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    rows: list[dict] = []
    if args.jit_cache:
        print(restore_jit_cache(args.jit_cache), flush=True)
    try:
        for spec in runs:
            left = args.budget - (time.time() - started)
            utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            if left < MIN_START_S:
                row: dict = {"rc": "not run", "error": f"{left:.0f} s of budget left"}
            else:
                try:
                    row = run_one(spec, stage, out, min(args.timeout, left - 15))
                except Exception as error:  # this script's fault: go on
                    row = {"rc": "parent error", "error": repr(error)}
            row = {"spec": spec, **common, "utc": utc, **row}
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(summary_line(row), flush=True)
            rows.append(row)
            if len(rows) == 1 and row["rc"] != "not run":
                print(save_jit_cache(out / "jit-cache.tgz"), flush=True)
    finally:
        print(save_jit_cache(out / "jit-cache.tgz"), flush=True)
    print(f"rows appended to {results}; {time.time() - started:.0f} s in all")
    for line in [*perf_table(rows), *proxy_report(rows)]:
        print(line, flush=True)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
