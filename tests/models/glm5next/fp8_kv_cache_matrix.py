# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The KV-cache selection matrix: its cases, and the worker that resolves
them on one vLLM tree.

`python fp8_kv_cache_matrix.py REQUEST.json` (run by
`test_fp8_kv_cache_selection.py`, once per tree) stands up vLLM's CUDA
platform with a mocked compute capability, creates each case's engine
config with `EngineArgs`, and resolves the backend and cache dtype of the
target's MLA layers and of the drafter's attention with vLLM's own
`get_attn_backend` and sparse-MLA canonicalization, in the order the model
builds them: the target first, its canonical dtype written back into the
shared `CacheConfig` as `MLAAttention.__init__` does, then the drafter with
the config Model Runner V2's speculator passes to `get_model` (and, where
the release still has it, with the V1 proposer's: `drafter_v1`). It prints
`RESULTS <json>`: per case the selections, every error with its type,
message and whether vLLM raised it, and the fp8_ds_mla row bytes.
"""

import contextlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any
from unittest import mock

import glm5next_verify as verify

GLM = "glm512"
DEEPSEEK = "ds576"
EAGLE3 = "eagle3-draft"
LLAMA_DRAFT = "llama-draft"
DSPARK_DRAFT = "qwen3-dspark-draft"
FI_SM90 = "FLASHINFER_MLA_SPARSE_SM90"
FLASHMLA = "FLASHMLA_SPARSE"
FA_SPARSE = "FLASH_ATTN_MLA_SPARSE"

CAPABILITIES = {"sm90": (9, 0), "sm100": (10, 0)}
KV_CACHE_DTYPES = ["auto", "fp8", "fp8_e4m3", "fp8_ds_mla"]
BACKENDS = [None, FLASHMLA, FI_SM90, FA_SPARSE]
MTP = {"method": "mtp", "num_speculative_tokens": 1}
SPECULATIVE_CONFIGS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "mtp": MTP,
    f"mtp_backend={FI_SM90}": MTP | {"attention_backend": FI_SM90},
    f"mtp_backend={FLASHMLA}": MTP | {"attention_backend": FLASHMLA},
    "mtp_kv=fp8_e4m3": MTP | {"kv_cache_dtype": "fp8_e4m3"},
    "eagle3": {"method": "eagle3", "model": EAGLE3, "num_speculative_tokens": 1},
    "draft_model": {
        "method": "draft_model",
        "model": LLAMA_DRAFT,
        "num_speculative_tokens": 1,
    },
    # a DSpark drafter (Qwen3 layout, config only)
    "dspark": {"method": "dspark", "model": DSPARK_DRAFT, "num_speculative_tokens": 4},
}
PARALLEL: dict[str, dict[str, int]] = {
    "tp1": {},
    # 32 heads per rank: FlashMLA's MIN_HEADS_FOR_BF16_PREFILL
    "tp2-dcp2": {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    # 16 heads per rank
    "tp4-dcp2": {"tensor_parallel_size": 4, "decode_context_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
}


def case_id(
    capability: str, model: str, dtype: str, backend, spec: str, par: str = "tp1"
) -> str:
    suffix = "" if par == "tp1" else f"-{par}"
    return (
        f"{capability}-{model}-{dtype}-backend={backend or 'auto'}-spec={spec}{suffix}"
    )


def _case(capability, model, dtype, backend, spec, par="tp1") -> dict[str, Any]:
    return {
        "group": f"{capability}-{model}-{dtype}" + ("" if par == "tp1" else "-par"),
        "capability": CAPABILITIES[capability],
        "model": model,
        "kv_cache_dtype": dtype,
        "backend": backend,
        "speculative_config": SPECULATIVE_CONFIGS[spec],
        "parallel": PARALLEL[par],
    }


CASES: dict[str, dict[str, Any]] = {
    case_id(*key): _case(*key)
    for key in (
        (capability, model, dtype, backend, spec)
        for capability in CAPABILITIES
        for model in (GLM, DEEPSEEK)
        for dtype in KV_CACHE_DTYPES
        for backend in BACKENDS
        for spec in SPECULATIVE_CONFIGS
    )
}
"""kv dtype x --attention-backend x speculative config x capability x
geometry (GLM-5.3-Flash's 512 NoPE latent, DeepSeek-V3.2's 576)."""
CASES |= {
    case_id(*key): _case(*key)
    for key in (
        ("sm90", model, dtype, None, spec, par)
        for model in (GLM, DEEPSEEK)
        for dtype in ("auto", "fp8")
        for spec in ("none", "mtp")
        for par in PARALLEL
        if par != "tp1"
    )
}
"""Tensor and decode-context parallelism on SM90."""

GROUPS = sorted({case["group"] for case in CASES.values()})


# --------------------------------------------------------------------------
# Model directories (config only, no weights)
# --------------------------------------------------------------------------


def deepseek_v32_config() -> dict[str, Any]:
    """DeepSeek-V3.2's MLA geometry (512 NoPE + 64 RoPE latent) on a
    two-layer model: the fields vLLM reads to pick a backend."""
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "vocab_size": 154880,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "max_position_embeddings": 163840,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
        "n_routed_experts": 288,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 1,
    }


def llama_draft_config(architecture: str) -> dict[str, Any]:
    """A one-layer Llama drafter sized for either target."""
    return {
        "architectures": [architecture],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": 1,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 154880,
        "draft_vocab_size": 32000,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def qwen3_dspark_draft_config() -> dict[str, Any]:
    """A config-only DSpark drafter (no weights are read): the Qwen3 layout
    vLLM 0.34.0 registers for `DSparkDraftModel` with model_type qwen3,
    conditioned on two target layers that both targets have."""
    return llama_draft_config("DSparkDraftModel") | {
        "model_type": "qwen3",
        "block_size": 4,
        "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 0},
    }


def write_model_dirs(root: Path) -> dict[str, str]:
    configs = {
        GLM: verify.load_glm5_flash_config(),
        DEEPSEEK: deepseek_v32_config(),
        EAGLE3: llama_draft_config("LlamaForCausalLMEagle3"),
        LLAMA_DRAFT: llama_draft_config("LlamaForCausalLM"),
        DSPARK_DRAFT: qwen3_dspark_draft_config(),
    }
    return {
        m: str(verify.write_model_dir(root / m, config=c)) for m, c in configs.items()
    }


# --------------------------------------------------------------------------
# Worker side: resolve every case on a mocked CUDA device.
# --------------------------------------------------------------------------


class _DraftConfigCaptured(Exception):
    pass


def _v2_drafter_config(vllm_config):
    """The config Model Runner V2's speculator builds the drafter with: what
    `load_eagle_model` passes to `get_model`."""
    from vllm.v1.worker.gpu.spec_decode.eagle import utils

    captured = {}

    def get_model(*, vllm_config, model_config):
        captured["config"] = vllm_config
        raise _DraftConfigCaptured

    with (
        mock.patch.object(utils, "get_model", get_model),
        contextlib.suppress(_DraftConfigCaptured),
    ):
        utils.load_eagle_model(None, vllm_config)  # type: ignore[arg-type]
    return captured["config"]


def _v1_drafter_config(vllm_config):
    """The config the V1 proposer builds the drafter with, where the release
    still has one (0.33.0's `SpecDecodeBaseProposer`); None elsewhere."""
    from types import SimpleNamespace

    try:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    except ImportError:
        return None
    proposer = SimpleNamespace(
        vllm_config=vllm_config, speculative_config=vllm_config.speculative_config
    )
    return SpecDecodeBaseProposer._create_draft_vllm_config(proposer)  # type: ignore[arg-type]


def _error(exc: BaseException) -> dict[str, Any]:
    """An error's type, message, and whether vLLM itself raised it (the
    innermost frame is in the vllm package, or pydantic validated one of
    vLLM's configs): the verdict of a configuration, not of this host."""
    import vllm

    package = str(Path(vllm.__file__).resolve().parent)
    frames = traceback.extract_tb(exc.__traceback__)
    files = [str(Path(f.filename).resolve()) for f in frames]
    name = type(exc).__name__
    raised_by_vllm = bool(files) and files[-1].startswith(package)
    if name == "ValidationError":
        raised_by_vllm = any(f.startswith(package) for f in files)
    return {
        "type": name,
        "message": str(exc),
        "deliberate": raised_by_vllm and name in ("ValueError", "ValidationError"),
        "where": files[-1] if files else "",
    }


def _layer_selection(
    vllm_config, model_config, parallel: dict[str, int], notes: dict[str, Any]
) -> str:
    """`BACKEND/kv_cache_dtype` of one attention layer of `model_config`, as
    its attention layer's constructor resolves it; a sparse MLA layer writes
    the canonical dtype back into the (shared) cache config."""
    import torch

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

    text_config = model_config.hf_text_config
    use_mla = model_config.is_deepseek_mla
    if use_mla:
        head_size = text_config.kv_lora_rank + text_config.qk_rope_head_dim
    else:
        head_size = model_config.get_head_size()
    num_heads = text_config.num_attention_heads // parallel.get(
        "tensor_parallel_size", 1
    )
    cache_config = vllm_config.cache_config
    kv_cache_dtype = cache_config.cache_dtype
    _cached_get_attn_backend.cache_clear()
    try:
        with set_current_vllm_config(vllm_config), verify.cuda_allocations_on_meta():
            backend = get_attn_backend(
                head_size,
                torch.bfloat16,
                kv_cache_dtype,
                use_mla=use_mla,
                use_sparse=use_mla,
                num_heads=num_heads,
            )
    except Exception as e:  # noqa: BLE001 - the selection's verdict
        notes.setdefault("errors", []).append(_error(e))
        return f"error: {type(e).__name__}"
    if use_mla:
        canonical = _canonicalize_sparse_mla_kv_cache_dtype(backend, kv_cache_dtype)
        if canonical != kv_cache_dtype:
            # Patch 0002's step of MLAAttention.__init__, where the tree has it.
            keep = getattr(mla_attention, "_keep_draft_kv_cache_dtype", None)
            if keep is not None:
                with set_current_vllm_config(vllm_config):
                    keep(kv_cache_dtype)
            cache_config.cache_dtype = kv_cache_dtype = canonical
    return f"{backend.get_name()}/{kv_cache_dtype}"


def _mla_row_bytes(vllm_config, selection: str) -> int:
    """KV bytes per token the MLA layer's spec charges, as
    `MLAAttention.get_kv_cache_spec` computes them for `selection`."""
    from functools import partial
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    name, kv_cache_dtype = selection.split("/")
    impl_cls = AttentionBackendEnum[name].get_class().get_impl_cls()
    text_config = vllm_config.model_config.hf_text_config
    impl = SimpleNamespace(
        kv_lora_rank=text_config.kv_lora_rank,
        qk_rope_head_dim=text_config.qk_rope_head_dim,
    )
    if hasattr(impl_cls, "get_fp8_ds_mla_row_bytes"):  # 0.34.0 asks the impl
        impl.get_fp8_ds_mla_row_bytes = partial(impl_cls.get_fp8_ds_mla_row_bytes, impl)
    layer = SimpleNamespace(
        impl=impl,
        kv_cache_dtype=kv_cache_dtype,
        head_size=text_config.kv_lora_rank + text_config.qk_rope_head_dim,
        sliding_window=None,
        topk_buffer_width=None,
        indexer=None,
        non_causal_multi_token_decode=False,
    )
    with set_current_vllm_config(vllm_config):
        spec = MLAAttention.get_kv_cache_spec(layer, vllm_config)  # type: ignore[arg-type]
    # an MLA layer's spec (MLAAttentionSpec) has it
    return spec.real_page_size_bytes // spec.block_size  # type: ignore[attr-defined]


def resolve_case(case: dict[str, Any], model_dirs: dict[str, str]) -> dict[str, Any]:
    """One case's selections per layer kind ("config" when the engine
    config itself is refused), its errors and its fp8_ds_mla row bytes."""
    from vllm.engine.arg_utils import EngineArgs

    verify.use_mocked_cuda_platform(*case["capability"])
    notes: dict[str, Any] = {}
    spec = case["speculative_config"]
    if spec is not None and "model" in spec:
        spec = spec | {"model": model_dirs[spec["model"]]}
    try:
        vllm_config = EngineArgs(
            model=model_dirs[case["model"]],
            load_format="dummy",
            skip_tokenizer_init=True,
            enforce_eager=True,
            enable_prefix_caching=False,
            kv_cache_dtype=case["kv_cache_dtype"],
            attention_backend=case["backend"],
            speculative_config=spec,
            **case["parallel"],
        ).create_engine_config()
    except Exception as e:  # noqa: BLE001 - the configuration's verdict
        return {
            "selection": {"config": f"error: {type(e).__name__}"},
            "errors": [_error(e)],
        }
    target = _layer_selection(
        vllm_config, vllm_config.model_config, case["parallel"], notes
    )
    selection = {"target": target}
    if target.endswith("/fp8_ds_mla"):
        notes["row_bytes"] = _mla_row_bytes(vllm_config, target)
    if vllm_config.speculative_config is not None:
        drafters = {
            "drafter": _v2_drafter_config(vllm_config),
            "drafter_v1": _v1_drafter_config(vllm_config),
        }
        for layer, draft_config in drafters.items():
            if draft_config is not None:
                selection[layer] = _layer_selection(
                    draft_config,
                    vllm_config.speculative_config.draft_model_config,
                    case["parallel"],
                    notes,
                )
    return {"selection": selection, **notes}


def resolve_cases(model_dirs: dict[str, str], case_ids: list[str]) -> dict[str, Any]:
    """Every case's result, and which vLLM resolved them."""
    verify.load_libcuda()
    verify.use_mocked_cuda_platform(*CAPABILITIES["sm90"])
    verify.init_single_process_groups()
    import vllm

    return {
        "vllm_file": str(Path(vllm.__file__).resolve()),
        "vllm_version": vllm.__version__,
        "cases": {c: resolve_case(CASES[c], model_dirs) for c in case_ids},
    }


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    print("RESULTS " + json.dumps(resolve_cases(**request)))
