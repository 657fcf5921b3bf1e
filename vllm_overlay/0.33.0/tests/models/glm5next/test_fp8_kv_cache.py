# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`--kv-cache-dtype fp8` for GLM-5.3-Flash's sparse MLA layers.

On Hopper, `fp8` gives GLM-5.3-Flash's 512-wide NoPE latent FlashMLA's
fp8_ds_mla rows (656 B per token per layer instead of 1024 B), as it does for
576-wide sparse MLA models; `fp8_e4m3` keeps FlashInfer's per-tensor FP8.

The backend-selection cases run on CPU: a subprocess (this file run as a
script) stands up vLLM's CUDA platform with a mocked device capability, creates
the engine config, and resolves the target's and the MTP layer's MLA backend
with `_get_backend_priorities` and each candidate's `validate_configuration`,
the way `CudaPlatform.get_valid_backends` does. Without a GPU, the CUDA
extension's three driver symbols come from a stub `libcuda.so.1` built here.

The rest is a pure-torch reference of the 656-byte row.
"""

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# --- the fp8_ds_mla row (see vllm/v1/attention/backends/mla/flashmla_sparse.py)
NOPE_DIM = 512
ROPE_DIM = 64
TILE = 128
NUM_TILES = NOPE_DIM // TILE
SCALES_OFFSET = NOPE_DIM
ROPE_OFFSET = SCALES_OFFSET + NUM_TILES * 4
ROW_BYTES = ROPE_OFFSET + ROPE_DIM * 2
BF16_ROW_BYTES = NOPE_DIM * 2

GLM = "glm512"
DEEPSEEK = "ds576"
TARGET = "target"
MTP = "mtp"

_STUB_SOURCE = """
int cuGetProcAddress_v2(void) { return 100; }
int cuPointerGetAttribute(void) { return 100; }
int cuTensorMapEncodeTiled(void) { return 100; }
"""


def _deepseek_v32_config() -> dict[str, Any]:
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


def _write_model_dir(root: Path, model: str, config: dict[str, Any]) -> Path:
    path = root / model
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


# --------------------------------------------------------------------------
# Subprocess side: resolve the MLA backends of a model on a mocked CUDA device.
# --------------------------------------------------------------------------


def _use_mocked_cuda_platform(major: int, minor: int) -> None:
    """Make vLLM's CUDA platform current, reporting the given capability."""
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(major, minor)

    mocked_cls = type(
        "MockedCudaPlatform",
        (CudaPlatform,),
        {"get_device_capability": classmethod(get_device_capability)},
    )
    old = platforms.current_platform
    new = mocked_cls()
    platforms.current_platform = new
    # Modules imported so far bound the old platform by name.
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(module, "current_platform", 0) is old:
            module.__dict__["current_platform"] = new


def _select_mla_backend(vllm_config, head_size: int, num_heads: int) -> str:
    """Backend an MLA layer gets: the explicit one (validated alone, by
    vLLM's own selector) or the first valid one in priority order."""
    from vllm.platforms import current_platform
    from vllm.platforms.cuda import _get_backend_priorities
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.selector import AttentionSelectorConfig

    kv_cache_dtype = vllm_config.cache_config.cache_dtype
    selector_config = AttentionSelectorConfig(
        head_size=head_size,
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_cache_dtype,
        block_size=None,
        use_mla=True,
        use_sparse=True,
        attn_type=AttentionType.DECODER,
    )
    capability = current_platform.get_device_capability()
    assert capability is not None
    backend = vllm_config.attention_config.backend
    if backend is not None:
        current_platform.get_attn_backend_cls(backend, selector_config, num_heads)
        return backend.name
    reasons = {}
    for candidate in _get_backend_priorities(
        use_mla=True,
        device_capability=capability,
        num_heads=num_heads,
        kv_cache_dtype=kv_cache_dtype,
        head_size=head_size,
    ):
        try:
            backend_class = candidate.get_class()
        except Exception as e:  # noqa: BLE001 - e.g. CUDA allocated on import
            reasons[candidate.name] = [f"{type(e).__name__}: {e}"]
            continue
        invalid = backend_class.validate_configuration(
            device_capability=capability, **selector_config._asdict()
        )
        if not invalid:
            return candidate.name
        reasons[candidate.name] = invalid
    raise ValueError(f"No valid attention backend found. Reasons: {reasons}")


def _resolve_layer(vllm_config, head_size: int, num_heads: int) -> dict[str, Any]:
    """Backend, cache dtype and KV bytes per token of one sparse MLA layer, as
    MLAAttention.__init__ and get_kv_cache_spec resolve them."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import (
        MLAAttention,
        _canonicalize_sparse_mla_kv_cache_dtype,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import AttentionSpec

    with set_current_vllm_config(vllm_config):
        name = _select_mla_backend(vllm_config, head_size, num_heads)
        kv_cache_dtype = _canonicalize_sparse_mla_kv_cache_dtype(
            AttentionBackendEnum[name].get_class(),
            vllm_config.cache_config.cache_dtype,
        )
        layer = SimpleNamespace(
            kv_cache_dtype=kv_cache_dtype,
            head_size=head_size,
            sliding_window=None,
            topk_buffer_width=None,
            indexer=None,
            non_causal_multi_token_decode=False,
        )
        spec = MLAAttention.get_kv_cache_spec(layer, vllm_config)  # type: ignore[arg-type]
    assert isinstance(spec, AttentionSpec)
    return {
        "backend": name,
        "kv_cache_dtype": kv_cache_dtype,
        "bytes_per_token": spec.real_page_size_bytes // spec.block_size,
    }


def _resolve_case(case: dict[str, Any], model_dir: str) -> dict[str, Any]:
    from types import SimpleNamespace

    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    _use_mocked_cuda_platform(*case["capability"])
    vllm_config = EngineArgs(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_cache_dtype=case["kv_cache_dtype"],
        attention_backend=case["backend"],
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()
    text_config = vllm_config.model_config.hf_text_config
    head_size = text_config.kv_lora_rank + text_config.qk_rope_head_dim
    num_heads = text_config.num_attention_heads
    # The MTP layer's config, as the proposer derives it from the target's.
    proposer = SimpleNamespace(
        speculative_config=vllm_config.speculative_config, vllm_config=vllm_config
    )
    draft_config = SpecDecodeBaseProposer._create_draft_vllm_config(proposer)  # type: ignore[arg-type]
    return {
        TARGET: _resolve_layer(vllm_config, head_size, num_heads),
        MTP: _resolve_layer(draft_config, head_size, num_heads),
    }


def _worker(cases: dict[str, dict[str, Any]], model_dirs: dict[str, str]) -> None:
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_GLOBAL)
    except OSError:
        ctypes.CDLL(os.environ["GLM5NEXT_TEST_LIBCUDA_STUB"], mode=os.RTLD_GLOBAL)
    from vllm.v1.attention.backends.mla.flashmla_sparse import FP8_DS_MLA_ROPE_DIM

    results: dict[str, Any] = {}
    for case_id, case in cases.items():
        try:
            results[case_id] = _resolve_case(case, model_dirs[case["model"]])
        except Exception as e:  # noqa: BLE001 - reported back to the test
            results[case_id] = {"error": f"{type(e).__name__}: {e}"}
    glm = results.get("sm90-fp8_ds_mla-glm512", {})
    results["constants"] = {
        "rope_dim": FP8_DS_MLA_ROPE_DIM,
        "row_bytes": glm.get(TARGET, {}).get("bytes_per_token"),
    }
    print("RESULTS " + json.dumps(results))


# --------------------------------------------------------------------------
# Test side.
# --------------------------------------------------------------------------

SM90 = (9, 0)
SM100 = (10, 0)


def _case(
    model: str, capability: tuple[int, int], dtype: str, backend: str | None = None
) -> dict[str, Any]:
    return {
        "model": model,
        "capability": capability,
        "kv_cache_dtype": dtype,
        "backend": backend,
    }


def _layer(backend: str, dtype: str, nbytes: int) -> dict[str, Any]:
    return {"backend": backend, "kv_cache_dtype": dtype, "bytes_per_token": nbytes}


FI_SM90 = "FLASHINFER_MLA_SPARSE_SM90"
FI_SM100 = "FLASHINFER_MLA_SPARSE"
FLASHMLA = "FLASHMLA_SPARSE"
FA_SPARSE = "FLASH_ATTN_MLA_SPARSE"

# case id -> (case, expected target/MTP layer). The patch changes only
# sm90-fp8-glm512 and the explicit-backend fp8 cases of GLM on SM90.
SELECTION_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sm90-auto-glm512": (_case(GLM, SM90, "auto"), _layer(FI_SM90, "auto", 1024)),
    "sm90-fp8-glm512": (_case(GLM, SM90, "fp8"), _layer(FLASHMLA, "fp8_ds_mla", 656)),
    "sm90-fp8_e4m3-glm512": (
        _case(GLM, SM90, "fp8_e4m3"),
        _layer(FI_SM90, "fp8_e4m3", 512),
    ),
    "sm90-fp8_ds_mla-glm512": (
        _case(GLM, SM90, "fp8_ds_mla"),
        _layer(FLASHMLA, "fp8_ds_mla", 656),
    ),
    # The MTP drafter never inherits --attention-backend (see
    # SpecDecodeBaseProposer._create_draft_vllm_config); it auto-selects.
    "sm90-auto-flashmla_sparse-glm512": (
        _case(GLM, SM90, "auto", FLASHMLA),
        _layer(FLASHMLA, "auto", 1024) | {MTP: _layer(FI_SM90, "auto", 1024)},
    ),
    "sm90-fp8-flashmla_sparse-glm512": (
        _case(GLM, SM90, "fp8", FLASHMLA),
        _layer(FLASHMLA, "fp8_ds_mla", 656),
    ),
    "sm90-fp8-flashinfer_sm90-glm512": (
        _case(GLM, SM90, "fp8", FI_SM90),
        _layer(FI_SM90, "fp8", 512),
    ),
    "sm100-auto-glm512": (_case(GLM, SM100, "auto"), _layer(FI_SM100, "fp8", 512)),
    "sm100-fp8-glm512": (_case(GLM, SM100, "fp8"), _layer(FI_SM100, "fp8", 512)),
    "sm100-fp8_e4m3-glm512": (
        _case(GLM, SM100, "fp8_e4m3"),
        _layer(FI_SM100, "fp8_e4m3", 512),
    ),
    "sm90-auto-ds576": (_case(DEEPSEEK, SM90, "auto"), _layer(FA_SPARSE, "auto", 1152)),
    "sm90-fp8-ds576": (
        _case(DEEPSEEK, SM90, "fp8"),
        _layer(FLASHMLA, "fp8_ds_mla", 656),
    ),
    "sm90-fp8_e4m3-ds576": (
        _case(DEEPSEEK, SM90, "fp8_e4m3"),
        _layer(FI_SM90, "fp8_e4m3", 576),
    ),
    "sm90-fp8_ds_mla-ds576": (
        _case(DEEPSEEK, SM90, "fp8_ds_mla"),
        _layer(FLASHMLA, "fp8_ds_mla", 656),
    ),
    "sm90-fp8-flashmla_sparse-ds576": (
        _case(DEEPSEEK, SM90, "fp8", FLASHMLA),
        _layer(FLASHMLA, "fp8_ds_mla", 656),
    ),
    "sm100-fp8-ds576": (_case(DEEPSEEK, SM100, "fp8"), _layer(FI_SM100, "fp8", 576)),
    "sm100-fp8_e4m3-ds576": (
        _case(DEEPSEEK, SM100, "fp8_e4m3"),
        _layer(FI_SM100, "fp8_e4m3", 576),
    ),
    "sm100-fp8_ds_mla-ds576": (
        _case(DEEPSEEK, SM100, "fp8_ds_mla"),
        _layer(FLASHMLA, "fp8_ds_mla", 656),
    ),
}

# case id -> (case, substrings the error must contain)
ERROR_CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "sm100-fp8_ds_mla-glm512": (
        _case(GLM, SM100, "fp8_ds_mla"),
        ["No valid attention backend"],
    ),
    "sm90-fp8_e4m3-flashmla_sparse-glm512": (
        _case(GLM, SM90, "fp8_e4m3", FLASHMLA),
        [FLASHMLA, "fp8_ds_mla"],
    ),
    "sm90-fp8-flash_attn_mla_sparse-glm512": (
        _case(GLM, SM90, "fp8", FA_SPARSE),
        [FA_SPARSE, "fp8", f"--attention-backend {FLASHMLA}"],
    ),
}


def _load_libcuda_or_stub(tmp_dir: Path) -> dict[str, str]:
    """Environment for the worker: nothing if the driver is present, else the
    path of a stub built here."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return {}
    except OSError:
        pass
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs libcuda.so.1 or gcc to build a driver stub")
    assert gcc is not None  # pytest.skip does not return
    source = tmp_dir / "libcuda_stub.c"
    source.write_text(_STUB_SOURCE)
    library = tmp_dir / "libcuda.so.1"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", library, source],
        check=True,
    )
    return {"GLM5NEXT_TEST_LIBCUDA_STUB": str(library)}


@pytest.fixture(scope="module")
def selections(
    tmp_path_factory: pytest.TempPathFactory, glm5_flash_config: dict[str, Any]
) -> dict[str, Any]:
    tmp_dir = tmp_path_factory.mktemp("fp8_kv_cache")
    env = os.environ | _load_libcuda_or_stub(tmp_dir)
    configs = {GLM: glm5_flash_config, DEEPSEEK: _deepseek_v32_config()}
    model_dirs = {m: str(_write_model_dir(tmp_dir, m, c)) for m, c in configs.items()}
    cases = {k: v[0] for k, v in (SELECTION_CASES | ERROR_CASES).items()}
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(cases), json.dumps(model_dirs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("layer", [TARGET, MTP])
@pytest.mark.parametrize("case_id", list(SELECTION_CASES))
def test_backend_and_cache_dtype(
    selections: dict[str, Any], case_id: str, layer: str
) -> None:
    result = selections[case_id]
    assert "error" not in result, result["error"]
    expected = SELECTION_CASES[case_id][1]
    expected = expected.get(layer, expected)
    got = result[layer]
    assert (got["backend"], got["kv_cache_dtype"]) == (
        expected["backend"],
        expected["kv_cache_dtype"],
    )


@pytest.mark.parametrize("layer", [TARGET, MTP])
@pytest.mark.parametrize("case_id", list(SELECTION_CASES))
def test_kv_cache_bytes_per_token(
    selections: dict[str, Any], case_id: str, layer: str
) -> None:
    result = selections[case_id]
    assert "error" not in result, result["error"]
    expected = SELECTION_CASES[case_id][1]
    expected = expected.get(layer, expected)["bytes_per_token"]
    assert result[layer]["bytes_per_token"] == expected


@pytest.mark.parametrize("case_id", list(ERROR_CASES))
def test_unservable_combination_is_an_error(
    selections: dict[str, Any], case_id: str
) -> None:
    result = selections[case_id]
    assert "error" in result, result
    for needle in ERROR_CASES[case_id][1]:
        assert needle in result["error"]


def test_row_layout_matches_vllm(selections: dict[str, Any]) -> None:
    assert selections["constants"] == {
        "rope_dim": ROPE_DIM,
        "row_bytes": ROW_BYTES,
    }


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]), json.loads(sys.argv[2]))


def test_sparse_topk_buffer_width(glm5_flash_config: dict[str, Any]) -> None:
    """The sparse decode index keeps KPool's 2048 picks plus up to three tail
    tokens, padded to a width FlashMLA's FP8 sparse kernel accepts."""
    from transformers import PretrainedConfig

    from vllm.models.glm5next.common.model import get_sparse_topk_buffer_width

    config = PretrainedConfig(**glm5_flash_config)
    width = get_sparse_topk_buffer_width(config)
    assert width >= 2048 + (4 - 1)
    assert width % 64 == 0
