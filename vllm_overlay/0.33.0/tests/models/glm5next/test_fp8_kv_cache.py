# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`--kv-cache-dtype fp8` for GLM-5.3-Flash's sparse MLA layers.

On Hopper, `fp8` gives GLM-5.3-Flash's 512-wide NoPE latent FlashMLA's
fp8_ds_mla rows (656 B per token per layer instead of 1024 B), as it does for
576-wide sparse MLA models, for the target and for every drafter that shares
its KV cache. Nothing else changes: `auto` stays BF16, `fp8_e4m3` keeps
FlashInfer's per-tensor rows, an attention backend chosen for the target or
for the drafter is honoured, and SM100 and 576-wide models are untouched.

The selection matrix runs on CPU. A subprocess (this file run as a script)
stands up vLLM's CUDA platform with a mocked device capability, creates the
engine config with `EngineArgs`, and resolves each layer's backend and cache
dtype with vLLM's own `get_attn_backend` and the sparse MLA canonicalization,
as `MLAAttention.__init__` does. The drafter's config is derived both ways
this release has: the one the default model runner (V2) passes to `get_model`
from `load_eagle_model` (`drafter`), and the V1 proposer's
`_create_draft_vllm_config` (`drafter_v1`, which never inherits
`--attention-backend`). Without a GPU,
the CUDA extension's three driver symbols come from a stub `libcuda.so.1`
built here.

`fp8_kv_cache_base_selections.json` records what the pristine release selects
for every case (`python test_fp8_kv_cache.py record`, run against it): each
case must select the same per layer, except the cases `intended_change` names.
The worker resolves only the cases the run collected, so one case chosen by
node id or `-k` takes seconds, not the whole matrix.
"""

import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

# --- the fp8_ds_mla row (see vllm/v1/attention/backends/mla/flashmla_sparse.py)
NOPE_DIM = 512
ROPE_DIM = 64
NUM_TILES = NOPE_DIM // 128
ROW_BYTES = NOPE_DIM + NUM_TILES * 4 + ROPE_DIM * 2

# The tests only read the worker's results, so they skip upstream's per-test
# cleanup: its full gc.collect adds about a second to each of ~390 tests.
pytestmark = pytest.mark.skip_global_cleanup

BASE_SELECTIONS = Path(__file__).with_name("fp8_kv_cache_base_selections.json")

GLM = "glm512"
DEEPSEEK = "ds576"
EAGLE3 = "eagle3-draft"
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
}


def _case_id(capability: str, model: str, dtype: str, backend, spec: str) -> str:
    return f"{capability}-{model}-{dtype}-backend={backend or 'auto'}-spec={spec}"


CASES: dict[str, dict[str, Any]] = {
    _case_id(capability, model, dtype, backend, spec): {
        "capability": CAPABILITIES[capability],
        "model": model,
        "kv_cache_dtype": dtype,
        "backend": backend,
        "speculative_config": SPECULATIVE_CONFIGS[spec],
    }
    for capability in CAPABILITIES
    for model in (GLM, DEEPSEEK)
    for dtype in KV_CACHE_DTYPES
    for backend in BACKENDS
    for spec in SPECULATIVE_CONFIGS
}
"""kv dtype x --attention-backend x speculative config x capability x
geometry (GLM-5.3-Flash's 512 NoPE latent, DeepSeek-V3.2's 576)."""

_STUB_SOURCE = """
int cuGetProcAddress_v2(void) { return 100; }
int cuPointerGetAttribute(void) { return 100; }
int cuTensorMapEncodeTiled(void) { return 100; }
"""


def intended_change(case: dict[str, Any]) -> dict[str, str] | None:
    """What this change selects where it differs from the release: GLM's
    `fp8` on SM90 becomes FLASHMLA_SPARSE's fp8_ds_mla for the target and an
    MTP drafter, unless a backend chosen for either cannot store those rows,
    the drafter asks for a cache dtype of its own, or the drafter is a model
    of its own (EAGLE3). Choosing FLASHMLA_SPARSE for one and another backend
    for the other is a startup error (it fails on the release too). None
    where nothing changes."""
    if (case["capability"], case["model"], case["kv_cache_dtype"]) != (
        CAPABILITIES["sm90"],
        GLM,
        "fp8",
    ):
        return None
    spec = case["speculative_config"] or {}
    pinned = {case["backend"]}
    if spec.get("method") == "mtp":
        pinned.add(spec.get("attention_backend"))
    pinned.discard(None)
    if FLASHMLA in pinned and len(pinned) > 1:
        return {"config": "error: ValidationError"}
    if pinned - {FLASHMLA} or spec.get("kv_cache_dtype") or spec.get("model"):
        return None
    fp8_ds_mla = f"{FLASHMLA}/fp8_ds_mla"
    if spec.get("method") == "mtp":
        return {"target": fp8_ds_mla, "drafter": fp8_ds_mla, "drafter_v1": fp8_ds_mla}
    return {"target": fp8_ds_mla}


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


def _eagle3_draft_config() -> dict[str, Any]:
    """A one-layer Llama EAGLE3 drafter sized for either target."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
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


def _write_model_dir(root: Path, model: str, config: dict[str, Any]) -> Path:
    path = root / model
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


# --------------------------------------------------------------------------
# Subprocess side: resolve every layer's backend on a mocked CUDA device.
# --------------------------------------------------------------------------


def use_mocked_cuda_platform(major: int, minor: int) -> None:
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
    """The config the V1 proposer builds the drafter with."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(
        vllm_config=vllm_config, speculative_config=vllm_config.speculative_config
    )
    return SpecDecodeBaseProposer._create_draft_vllm_config(proposer)  # type: ignore[arg-type]


def _layer_selection(vllm_config, model_config, notes: dict[str, Any]) -> str:
    """`BACKEND/kv_cache_dtype` of one attention layer of `model_config`, as
    its attention layer's constructor resolves it."""
    import torch

    from vllm.config import set_current_vllm_config
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
    kv_cache_dtype = vllm_config.cache_config.cache_dtype
    _cached_get_attn_backend.cache_clear()
    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                head_size,
                torch.bfloat16,
                kv_cache_dtype,
                use_mla=use_mla,
                use_sparse=use_mla,
                num_heads=text_config.num_attention_heads,
            )
    except Exception as e:  # noqa: BLE001 - the selection's verdict
        notes["error"] = str(e)
        return f"error: {type(e).__name__}"
    if use_mla:
        kv_cache_dtype = _canonicalize_sparse_mla_kv_cache_dtype(
            backend, kv_cache_dtype
        )
    return f"{backend.get_name()}/{kv_cache_dtype}"


def _resolve_case(
    case: dict[str, Any], model_dirs: dict[str, str], notes: dict[str, Any]
) -> dict[str, str]:
    from vllm.engine.arg_utils import EngineArgs

    use_mocked_cuda_platform(*case["capability"])
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
        ).create_engine_config()
    except Exception as e:  # noqa: BLE001 - the configuration's verdict
        notes["error"] = str(e)
        return {"config": f"error: {type(e).__name__}"}
    target = _layer_selection(vllm_config, vllm_config.model_config, notes)
    result = {"target": target}
    if target.endswith("/fp8_ds_mla"):
        notes["row_bytes"] = _mla_row_bytes(vllm_config, target)
    if vllm_config.speculative_config is not None:
        draft_model_config = vllm_config.speculative_config.draft_model_config
        for layer, derive in (
            ("drafter", _v2_drafter_config),
            ("drafter_v1", _v1_drafter_config),
        ):
            result[layer] = _layer_selection(
                derive(vllm_config), draft_model_config, notes
            )
    return result


def _mla_row_bytes(vllm_config, selection: str) -> int:
    """KV bytes per token the MLA layer's spec charges, as
    `MLAAttention.get_kv_cache_spec` computes them for `selection`."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    kv_cache_dtype = selection.split("/")[1]
    text_config = vllm_config.model_config.hf_text_config
    layer = SimpleNamespace(
        kv_cache_dtype=kv_cache_dtype,
        head_size=text_config.kv_lora_rank + text_config.qk_rope_head_dim,
        sliding_window=None,
        topk_buffer_width=None,
        indexer=None,
        non_causal_multi_token_decode=False,
    )
    with set_current_vllm_config(vllm_config):
        spec = MLAAttention.get_kv_cache_spec(layer, vllm_config)  # type: ignore[arg-type]
    return spec.real_page_size_bytes // spec.block_size


def _init_single_process_groups() -> None:
    """One-rank process groups, as upstream's `dist_init` makes them: the
    drafter's load config asks for the pipeline-parallel group."""
    import tempfile

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    store = tempfile.mkstemp()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        distributed_init_method=f"file://{store}",
        local_rank=0,
        backend="gloo",
    )
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(1, 1)


def _resolve_cases(model_dirs: dict[str, str], case_ids: list[str]) -> dict[str, Any]:
    """Each case's selections; its last error message and the target's
    fp8_ds_mla row bytes, where there are."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_GLOBAL)
    except OSError:
        ctypes.CDLL(os.environ["GLM5NEXT_TEST_LIBCUDA_STUB"], mode=os.RTLD_GLOBAL)
    use_mocked_cuda_platform(*CAPABILITIES["sm90"])
    _init_single_process_groups()
    results: dict[str, Any] = {"cases": {}, "errors": {}, "row_bytes": {}}
    for case_id in case_ids:
        notes: dict[str, Any] = {}
        results["cases"][case_id] = _resolve_case(CASES[case_id], model_dirs, notes)
        if "error" in notes:
            results["errors"][case_id] = notes["error"]
        if "row_bytes" in notes:
            results["row_bytes"][case_id] = notes["row_bytes"]
    return results


# --------------------------------------------------------------------------
# Test side.
# --------------------------------------------------------------------------


def libcuda_stub_env(tmp_dir: Path) -> dict[str, str]:
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


def _model_dirs(root: Path, glm5_flash_config: dict[str, Any]) -> dict[str, str]:
    configs = {
        GLM: glm5_flash_config,
        DEEPSEEK: _deepseek_v32_config(),
        EAGLE3: _eagle3_draft_config(),
    }
    return {m: str(_write_model_dir(root, m, c)) for m, c in configs.items()}


def _run_worker(
    tmp_dir: Path, glm5_flash_config: dict[str, Any], case_ids: list[str]
) -> dict[str, Any]:
    """Resolve `case_ids` in a fresh interpreter (the mocked CUDA platform
    must not leak into other tests)."""
    env = os.environ | libcuda_stub_env(tmp_dir) | {"CUDA_VISIBLE_DEVICES": ""}
    request = tmp_dir / "request.json"
    model_dirs = _model_dirs(tmp_dir, glm5_flash_config)
    request.write_text(json.dumps({"model_dirs": model_dirs, "case_ids": case_ids}))
    proc = subprocess.run(
        [sys.executable, __file__, str(request)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-5000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


def _selected_case_ids(request: pytest.FixtureRequest) -> list[str]:
    """The cases that this module's collected tests read: every case in a
    full run, only the chosen ones under `-k` or a node id."""
    chosen = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is request.module and "case_id" in params:
            chosen.add(params["case_id"])
    return [case_id for case_id in CASES if case_id in chosen]


@pytest.fixture(scope="module")
def selections(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    glm5_flash_config: dict[str, Any],
) -> dict[str, Any]:
    return _run_worker(
        tmp_path_factory.mktemp("fp8_kv_cache"),
        glm5_flash_config,
        _selected_case_ids(request),
    )


@pytest.mark.parametrize("case_id", list(CASES))
def test_layers_select_as_the_release_except_the_intended_change(
    selections: dict[str, Any], case_id: str
) -> None:
    expected = json.loads(BASE_SELECTIONS.read_text())[case_id]
    change = intended_change(CASES[case_id])
    if change is not None:
        expected = change if "config" in change else expected | change
    assert selections["cases"][case_id] == expected


@pytest.mark.parametrize(
    "case_id",
    [
        _case_id("sm90", GLM, "fp8", "auto", "none"),
        _case_id("sm90", GLM, "fp8", "auto", "mtp"),
        _case_id("sm90", GLM, "fp8", FLASHMLA, "mtp"),
    ],
)
def test_fp8_ds_mla_row_bytes(selections: dict[str, Any], case_id: str) -> None:
    """The MLA layers' KV cache spec charges FlashMLA's 656-byte row."""
    assert selections["row_bytes"][case_id] == ROW_BYTES


@pytest.mark.parametrize(
    "case_id", [_case_id("sm90", GLM, "fp8", FLASHMLA, f"mtp_backend={FI_SM90}")]
)
def test_mixed_backends_error_says_what_to_choose(
    selections: dict[str, Any], case_id: str
) -> None:
    message = selections["errors"][case_id]
    assert f"Choose {FLASHMLA} for both" in message


def test_sparse_topk_buffer_width(glm5_flash_config: dict[str, Any]) -> None:
    """The sparse decode index keeps KPool's 2048 picks plus up to three tail
    tokens, padded to a width FlashMLA's FP8 sparse kernel accepts."""
    from transformers import PretrainedConfig

    from vllm.models.glm5next.common.model import get_sparse_topk_buffer_width

    config = PretrainedConfig(**glm5_flash_config)
    width = get_sparse_topk_buffer_width(config)
    assert width >= 2048 + (4 - 1)
    assert width % 64 == 0


def _record() -> None:
    """Write BASE_SELECTIONS from the vLLM this interpreter imports (run
    against the pristine release)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        config = json.loads(
            Path(__file__).with_name("glm-5.3-flash-config.json").read_text()
        )
        results = _run_worker(Path(tmp), config, list(CASES))
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in results["cases"].items()]
    BASE_SELECTIONS.write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":
    if sys.argv[1] == "record":
        _record()
    else:
        request = json.loads(Path(sys.argv[1]).read_text())
        print("RESULTS " + json.dumps(_resolve_cases(**request)))
