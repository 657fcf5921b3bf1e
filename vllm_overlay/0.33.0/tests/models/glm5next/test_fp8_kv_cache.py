# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`--kv-cache-dtype fp8` for GLM-5.3-Flash on Hopper: attention selection
gives its MLA layers FlashMLA's fp8_ds_mla rows, as DeepSeek-V3.2's. vLLM's
CUDA platform answers as an SM90 GPU; the warning's tests also pin the
backend and give it an attention impl that needs no GPU."""

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention.mla_attention import (
    MLAAttention,
    _canonicalize_sparse_mla_kv_cache_dtype,
)
from vllm.model_executor.models.config import Glm5NextModelConfig
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

pytestmark = pytest.mark.skip_global_cleanup

FLASHINFER = "FLASHINFER_MLA_SPARSE_SM90"
FLASHMLA = "FLASHMLA_SPARSE"
MTP = {"method": "mtp", "num_speculative_tokens": 1}
DS_MLA = f"{FLASHMLA}/fp8_ds_mla"


@contextmanager
def _on_hopper(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CUDA platform on an SM90 GPU (importing it needs the CUDA driver)."""
    import vllm.platforms

    cuda = pytest.importorskip(
        "vllm.platforms.cuda", reason="needs the CUDA driver", exc_type=ImportError
    )

    class Sm90CudaPlatform(cuda.CudaPlatform):  # type: ignore[name-defined]
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

    with monkeypatch.context() as m:
        m.setattr(vllm.platforms, "_current_platform", Sm90CudaPlatform())
        _cached_get_attn_backend.cache_clear()
        try:
            yield
        finally:
            _cached_get_attn_backend.cache_clear()


def _mla_selection(vllm_config, model_config) -> str:
    """`BACKEND/cache dtype` of a sparse MLA layer of `model_config`, its
    canonical dtype written back into the cache config as `MLAAttention`
    writes it."""
    text_config = model_config.hf_text_config
    cache_config = vllm_config.cache_config
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(
            text_config.kv_lora_rank + text_config.qk_rope_head_dim,
            model_config.dtype,
            cache_config.cache_dtype,
            use_mla=True,
            use_sparse=True,
            num_heads=text_config.num_attention_heads,
        )
    cache_config.cache_dtype = _canonicalize_sparse_mla_kv_cache_dtype(
        backend, cache_config.cache_dtype
    )
    return f"{backend.get_name()}/{cache_config.cache_dtype}"


@pytest.fixture
def engine_on_hopper(
    make_vllm_config, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[str, str | None]]:
    """Serves GLM-5.3-Flash with the given engine arguments on an SM90 GPU;
    returns the target's and the MTP drafter's MLA selection, built in that
    order from the configs vLLM builds them with."""

    def run(**engine_args) -> tuple[str, str | None]:
        vllm_config = make_vllm_config(**engine_args)
        with _on_hopper(monkeypatch):
            # create_engine_config runs it; on a CPU host, off Hopper.
            Glm5NextModelConfig.verify_and_update_config(vllm_config)
            target = _mla_selection(vllm_config, vllm_config.model_config)
            spec_config = vllm_config.speculative_config
            if spec_config is None:
                return target, None
            drafter = _mla_selection(
                spec_config.apply_draft_overrides(vllm_config),
                spec_config.draft_model_config,
            )
        return target, drafter

    return run


def test_fp8_selects_fp8_ds_mla_rows(engine_on_hopper) -> None:
    assert engine_on_hopper(kv_cache_dtype="fp8") == (DS_MLA, None)


def test_mtp_drafter_shares_fp8_ds_mla_rows(engine_on_hopper) -> None:
    dtypes = engine_on_hopper(kv_cache_dtype="fp8", speculative_config=MTP)
    assert dtypes == (DS_MLA, DS_MLA)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "selection"),
    [
        ("auto", f"{FLASHINFER}/auto"),
        ("fp8_e4m3", f"{FLASHINFER}/fp8_e4m3"),
        ("fp8_ds_mla", DS_MLA),
    ],
    ids=["auto-bf16", "fp8_e4m3-per-tensor", "fp8_ds_mla"],
)
def test_other_cache_dtypes_keep_their_rows(
    engine_on_hopper, kv_cache_dtype: str, selection: str
) -> None:
    assert engine_on_hopper(kv_cache_dtype=kv_cache_dtype) == (selection, None)


@pytest.mark.parametrize(
    ("backend", "selection"),
    [(FLASHMLA, DS_MLA), (FLASHINFER, f"{FLASHINFER}/fp8")],
    ids=["flashmla_sparse", "flashinfer"],
)
def test_explicit_backend_decides_the_rows(
    engine_on_hopper, backend: str, selection: str
) -> None:
    dtypes = engine_on_hopper(kv_cache_dtype="fp8", attention_backend=backend)
    assert dtypes == (selection, None)


@pytest.fixture
def config_on_hopper(
    make_vllm_config, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Any]:
    """GLM-5.3-Flash's `VllmConfig` as `create_engine_config` leaves it on an
    SM90 GPU (the model's config hook sees the device's family)."""

    def make(**engine_args) -> Any:
        with monkeypatch.context() as m:
            m.setattr(current_platform, "is_cuda", lambda: True)
            m.setattr(
                current_platform,
                "is_device_capability_family",
                lambda family, device_id=0: family == 90,
            )
            return make_vllm_config(**engine_args)

    return make


@pytest.mark.parametrize(
    "engine_args",
    [
        {"speculative_config": MTP | {"attention_backend": FLASHINFER}},
        {"speculative_config": MTP | {"kv_cache_dtype": "fp8_e4m3"}},
        {"speculative_config": MTP, "attention_backend": FLASHINFER},
    ],
    ids=["drafter-on-flashinfer", "drafter-on-fp8_e4m3", "target-on-flashinfer"],
)
def test_mtp_drafter_beside_per_tensor_rows_keeps_the_engine_on_them(
    config_on_hopper, engine_args: dict[str, Any]
) -> None:
    vllm_config = config_on_hopper(kv_cache_dtype="fp8", **engine_args)
    assert vllm_config.cache_config.cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize(
    "drafter",
    [{}, {"attention_backend": FLASHMLA}, {"kv_cache_dtype": "fp8"}],
    ids=["unpinned", "pinned-to-flashmla", "naming-fp8"],
)
def test_mtp_drafter_leaves_fp8_to_selection(
    config_on_hopper, drafter: dict[str, str]
) -> None:
    """It shares the target's CacheConfig (its attention metadata builders
    would read a dtype named for the drafter)."""
    spec = MTP | drafter
    vllm_config = config_on_hopper(kv_cache_dtype="fp8", speculative_config=spec)
    assert vllm_config.cache_config.cache_dtype == "fp8"
    assert vllm_config.speculative_config.kv_cache_dtype is None


def test_fp8_without_a_drafter_is_left_to_selection(config_on_hopper) -> None:
    vllm_config = config_on_hopper(kv_cache_dtype="fp8")
    assert vllm_config.cache_config.cache_dtype == "fp8"


def test_drafter_without_a_kv_cache_is_left_alone(config_on_hopper) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 2}
    vllm_config = config_on_hopper(kv_cache_dtype="fp8", speculative_config=spec)
    assert vllm_config.cache_config.cache_dtype == "fp8"
    assert vllm_config.speculative_config.kv_cache_dtype is None


def test_drafter_rules_leave_the_bf16_default_alone(config_on_hopper) -> None:
    spec = MTP | {"attention_backend": FLASHINFER}
    vllm_config = config_on_hopper(kv_cache_dtype="auto", speculative_config=spec)
    assert vllm_config.cache_config.cache_dtype == "auto"


@pytest.mark.parametrize(
    ("drafter_dtype", "expected"),
    [(None, "fp8_e4m3"), ("auto", "auto")],
    ids=["unset", "auto"],
)
def test_drafter_with_its_own_layers_keeps_its_dtype(
    config_on_hopper, tmp_path, drafter_dtype: str | None, expected: str
) -> None:
    """A draft-model (or EAGLE3, DSpark) drafter builds its own attention
    layers: they keep per-tensor rows (or the dtype asked for), never the
    target's fp8_ds_mla."""
    draft = tmp_path / "llama-draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(_LLAMA_DRAFT))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 1}
    spec["kv_cache_dtype"] = drafter_dtype
    vllm_config = config_on_hopper(kv_cache_dtype="fp8", speculative_config=spec)
    # What apply_draft_overrides gives the drafter a CacheConfig of its own with.
    assert vllm_config.speculative_config.kv_cache_dtype == expected


@pytest.mark.parametrize(
    ("is_cuda", "family"), [(True, 100), (False, 90)], ids=["sm100", "rocm-gfx9"]
)
def test_fp8_drafter_rules_are_hopper_only(
    make_vllm_config, monkeypatch, is_cuda: bool, family: int
) -> None:
    monkeypatch.setattr(current_platform, "is_cuda", lambda: is_cuda)
    monkeypatch.setattr(
        current_platform,
        "is_device_capability_family",
        lambda f, device_id=0: f == family,
    )
    spec = MTP | {"attention_backend": FLASHINFER}
    vllm_config = make_vllm_config(kv_cache_dtype="fp8", speculative_config=spec)
    assert vllm_config.cache_config.cache_dtype == "fp8"


def _warnings_on(backend: type, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The messages `MLAAttention` passes to `warning_once` from now on, its
    layers built on `backend` with a GPU-free attention impl (the device
    stub)."""
    import vllm.model_executor.layers.attention.mla_attention as mla_attention

    warnings: list[str] = []
    monkeypatch.setattr(
        mla_attention.logger, "warning_once", lambda msg, *a, **k: warnings.append(msg)
    )
    monkeypatch.setattr(mla_attention, "get_attn_backend", lambda *a, **k: backend)
    monkeypatch.setattr(
        backend, "get_impl_cls", staticmethod(lambda: _NoGpuSparseMLAImpl)
    )
    return warnings


def _mla_layer_on(
    backend: type, make_vllm_config, monkeypatch: pytest.MonkeyPatch
) -> tuple[MLAAttention, list[str]]:
    """The MLA attention of a GLM-5.3-Flash decoder layer built with fp8 on
    `backend`, and the messages passed to `warning_once` meanwhile."""
    import torch

    from vllm.models.glm5next.common.model import Glm5NextDecoderLayer
    from vllm.utils.torch_utils import set_default_torch_dtype

    warnings = _warnings_on(backend, monkeypatch)
    vllm_config = make_vllm_config(kv_cache_dtype="fp8")
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device("meta"),
    ):
        layer = Glm5NextDecoderLayer(
            vllm_config=vllm_config,
            config=vllm_config.model_config.hf_text_config,
            layer_idx=3,
            prefix="model.layers.3",
        )
    (attention,) = [m for m in layer.modules() if isinstance(m, MLAAttention)]
    return attention, warnings


@pytest.mark.usefixtures("distributed")
def test_fp8_warns_that_the_rows_change(make_vllm_config, monkeypatch) -> None:
    attention, warnings = _mla_layer_on(
        FlashMLASparseBackend, make_vllm_config, monkeypatch
    )
    assert attention.kv_cache_dtype == "fp8_ds_mla"
    (warning,) = [w for w in warnings if "fp8_ds_mla rows" in w]
    assert "656-byte fp8_ds_mla rows" in warning
    assert "fp8_e4m3 keeps the per-tensor rows" in warning


@pytest.mark.usefixtures("distributed")
def test_fp8_on_sm120s_sparse_backend_has_no_hopper_warning(
    make_vllm_config, monkeypatch
) -> None:
    """SM120's FlashInfer backend stored fp8 as fp8_ds_mla before this
    change: nothing changed there to warn of."""
    from vllm.v1.attention.backends.mla.flashinfer_mla_sparse import (
        FlashInferMLASparseSM120Backend,
    )

    attention, warnings = _mla_layer_on(
        FlashInferMLASparseSM120Backend, make_vllm_config, monkeypatch
    )
    assert attention.kv_cache_dtype == "fp8_ds_mla"
    assert not [w for w in warnings if "fp8_ds_mla rows" in w]


@pytest.mark.usefixtures("distributed")
def test_fp8_at_head_size_576_has_no_nope_warning(
    make_vllm_config, monkeypatch
) -> None:
    """DeepSeek-V3.2's 576-wide latent (RoPE included) stored fp8 as
    fp8_ds_mla on FLASHMLA_SPARSE before this change: nothing to warn of."""
    import torch

    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    warnings = _warnings_on(FlashMLASparseBackend, monkeypatch)
    vllm_config = make_vllm_config(kv_cache_dtype="fp8")
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device("meta"),
    ):
        attention = MLAAttention(
            num_heads=16,
            scale=1.0,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            q_lora_rank=1536,
            kv_lora_rank=512,
            kv_b_proj=ColumnParallelLinear(512, 16 * 256, bias=False),
            cache_config=vllm_config.cache_config,
            prefix="model.layers.3.self_attn.attn",
            use_sparse=True,
        )
    assert attention.kv_cache_dtype == "fp8_ds_mla"
    assert not [w for w in warnings if "fp8_ds_mla rows" in w]


class _NoGpuSparseMLAImpl:
    is_sparse = True
    supports_dense_mha_prefill = False
    dcp_world_size = pcp_world_size = 1

    def __init__(self, **kwargs) -> None:
        pass


_LLAMA_DRAFT = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 1,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 154880,
    "max_position_embeddings": 131072,
}
