# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU tests for the FlashMLA sparse backend NoPE-512 (GLM5Next) gates.

GLM5Next is rope-free MLA: qk_nope_head_dim=256, qk_rope_head_dim=0,
v_head_dim=256, kv_lora_rank=512 -> head_size 512. These tests pin the
selection contract only (no GPU required):

* ``get_supported_head_sizes`` advertises 512 so the backend is a candidate;
* ``supports_combination`` admits 512 only for rope-free models on SM90, with
  a bf16 cache or a quantized one stored as fp8_ds_mla (zero RoPE slot) that
  an MTP drafter can share, and rejects everything else;
* adding 512 must NOT reorder the SM100 priority list for bf16, which is why
  the bf16 arm is restricted to SM90.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backends.mla.flashmla_sparse import (
    QUANTIZED_DS_MLA_CACHE_FORMATS,
    FlashMLASparseBackend,
    _fp8_kv_pages,
)
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    KVQuantMode,
    MLAAttentionSpec,
)
from vllm.v1.worker.utils import (
    AttentionGroup,
    allocate_kv_cache,
    prepare_kernel_block_sizes,
    select_common_block_size,
)

SM90 = DeviceCapability(major=9, minor=0)
SM100 = DeviceCapability(major=10, minor=0)

BF16_CACHE_DTYPES = (None, "auto", "bfloat16", "float16")
NOPE_SM90_CACHE_DTYPES = (*BF16_CACHE_DTYPES, "fp8", "fp8_e4m3", "fp8_ds_mla")


def _supports_combination(head_size, kv_cache_dtype, capability):
    return FlashMLASparseBackend.supports_combination(
        head_size,
        torch.bfloat16,
        kv_cache_dtype,
        64,
        use_mla=True,
        has_sink=False,
        use_sparse=True,
        use_mm_prefix=False,
        device_capability=capability,
    )


@pytest.fixture
def rope_free_model(monkeypatch):
    """Patch get_current_vllm_config so the model looks like GLM5Next NoPE."""
    import vllm.config as cfg

    monkeypatch.setattr(
        cfg,
        "get_current_vllm_config",
        lambda: SimpleNamespace(
            model_config=SimpleNamespace(
                hf_text_config=SimpleNamespace(qk_rope_head_dim=0)
            ),
            speculative_config=None,
        ),
    )


@pytest.fixture
def rope_carrying_model(monkeypatch):
    """Patch get_current_vllm_config with a rope-carrying (576-style) model."""
    import vllm.config as cfg

    monkeypatch.setattr(
        cfg,
        "get_current_vllm_config",
        lambda: SimpleNamespace(
            model_config=SimpleNamespace(
                hf_text_config=SimpleNamespace(qk_rope_head_dim=64)
            )
        ),
    )


def test_supported_head_sizes_include_512():
    assert FlashMLASparseBackend.get_supported_head_sizes() == [576, 512]


def test_flashmla_bf16_nope_accepts_packed_manager_blocks():
    spec = MLAAttentionSpec(
        block_size=1152,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        cache_dtype_str="bfloat16",
        block_stride_alignment=1024,
    )
    num_blocks = 2
    layers = ["layer.0", "layer.1"]
    page_size = spec.page_size_bytes
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * len(layers) * page_size,
                layers=layers,
                layer_stride=page_size,
                block_stride=len(layers) * page_size,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    groups = [[AttentionGroup(FlashMLASparseBackend, layers, spec, 0)]]

    kernel_block_sizes = prepare_kernel_block_sizes(config, groups)
    caches = allocate_kv_cache(
        config,
        torch.device("cpu"),
        KVCacheLayout.BLHNC,
        kernel_block_sizes,
    )

    assert kernel_block_sizes == [1152]
    assert caches["layer.0"].shape == (num_blocks, 1, 1152, 512)


@pytest.mark.parametrize("sm100", [False, True])
def test_flashmla_quantized_cache_kernel_pages(monkeypatch, sm100):
    """Quantized blocks are read as 64-token pages; SM100 only row-aligns them
    (TMA) and keeps 64-token blocks."""
    monkeypatch.setattr(
        current_platform,
        "is_device_capability_family",
        lambda family, device_id=0: sm100 and family == 100,
    )
    spec = MLAAttentionSpec(
        block_size=1152,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.float8_e4m3fn,
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        state_content_bytes=656,
    )

    kernel_block_size = 64 if sm100 else 1152
    assert (
        select_common_block_size(1152, [FlashMLASparseBackend], [spec])
        == kernel_block_size
    )


def test_fp8_kv_pages_address_packed_blocks():
    """Token t of block b is row b * block_stride_rows + t of the 64-row pages;
    64-token blocks are passed through."""
    row, block_size, stride_rows = 656, 128, 192
    backing = torch.arange(3 * stride_rows).repeat_interleave(row)
    cache = backing.view(3, stride_rows, row)[:, :block_size]

    pages, block_stride_rows = _fp8_kv_pages(cache, block_size)
    assert block_stride_rows == stride_rows
    assert pages.shape[1:] == (64, row)
    slot = 2 * block_stride_rows + 100
    assert torch.equal(pages[slot // 64, slot % 64], cache[2, 100])

    pages, block_stride_rows = _fp8_kv_pages(cache[:, :64], 64)
    assert block_stride_rows is None
    assert torch.equal(pages, cache[:, :64])


def test_quantized_ds_mla_formats_are_the_envelope_set():
    assert frozenset({"fp8_ds_mla", "nvfp4_ds_mla"}) == QUANTIZED_DS_MLA_CACHE_FORMATS


@pytest.mark.parametrize("kv_cache_dtype", NOPE_SM90_CACHE_DTYPES)
def test_nope_512_sm90_rope_free_accepted(kv_cache_dtype, rope_free_model):
    assert _supports_combination(512, kv_cache_dtype, SM90) is None


@pytest.mark.parametrize("kv_cache_dtype", NOPE_SM90_CACHE_DTYPES)
def test_nope_512_sm90_rope_carrying_rejected(kv_cache_dtype, rope_carrying_model):
    reason = _supports_combination(512, kv_cache_dtype, SM90)
    assert reason is not None and "rope-free" in reason


@pytest.mark.parametrize("kv_cache_dtype", NOPE_SM90_CACHE_DTYPES)
def test_nope_512_sm100_rejected(kv_cache_dtype, rope_free_model):
    # The SM90 restriction is what keeps the SM100 priority order unchanged.
    reason = _supports_combination(512, kv_cache_dtype, SM100)
    assert reason is not None


@pytest.mark.parametrize("kv_cache_dtype", ("nvfp4_ds_mla",))
def test_nope_512_other_quantized_rejected(kv_cache_dtype, rope_free_model):
    reason = _supports_combination(512, kv_cache_dtype, SM90)
    assert reason is not None


@pytest.mark.parametrize("capability", [SM90, SM100], ids=["sm90", "sm100"])
@pytest.mark.parametrize(
    "kv_cache_dtype",
    ("auto", "bfloat16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"),
)
def test_576_unchanged_for_all_dtypes(kv_cache_dtype, capability):
    # DeepSeek 576 must be untouched by the NoPE-512 gates, except for the
    # pre-existing SM100-only nvfp4 rule.
    reason = _supports_combination(576, kv_cache_dtype, capability)
    if kv_cache_dtype == "nvfp4_ds_mla" and capability.major != 10:
        assert reason is not None and "SM100" in reason
    else:
        assert reason is None, reason


def _sparse_order(kv_cache_dtype, head_size, num_heads=32, capability=SM100):
    try:
        from vllm.platforms.cuda import _get_backend_priorities
    except ImportError as e:  # pragma: no cover - depends on host
        pytest.skip(f"CUDA platform unavailable on this host: {e}")

    priorities = _get_backend_priorities(
        use_mla=True,
        device_capability=capability,
        num_heads=num_heads,
        kv_cache_dtype=kv_cache_dtype,
        head_size=head_size,
    )
    sparse = {
        "FLASH_ATTN_MLA_SPARSE",
        "FLASH_ATTN_MLA_SPARSE_FA4",
        "FLASHMLA_SPARSE",
        "FLASHINFER_MLA_SPARSE",
        "FLASHINFER_MLA_SPARSE_SM90",
    }
    return [b.name for b in priorities if b.name in sparse]


@pytest.mark.parametrize("num_heads", [32, 64], ids=["tp2", "tp1"])
def test_sm100_bf16_512_priority_unchanged(num_heads):
    """Adding head_size 512 must not reorder the SM100 bf16 sparse list.

    On SM100 with >16 heads the hardcoded bf16 order is
    [FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE] (FlashMLA first). head_size 512
    must leave this untouched (identical to the 576 order); the guard that
    keeps bf16-512 from *serving* through FlashMLA on SM100 lives in
    supports_combination (gated to SM90), tested separately.
    """
    order512 = _sparse_order("auto", 512, num_heads=num_heads)
    order576 = _sparse_order("auto", 576, num_heads=num_heads)
    assert order512 == order576, order512
    assert order512[0] == "FLASHMLA_SPARSE", order512


def test_sm100_576_priority_unchanged():
    order = _sparse_order("auto", 576, num_heads=32)
    assert order[0] == "FLASHMLA_SPARSE", order


# drafter method, attention_backend and own dtype, cache dtype: refused
FI = "FLASHINFER_MLA_SPARSE_SM90"
MTP_DRAFTERS = {
    "mtp-on-flashinfer": ("mtp", FI, None, "fp8", True),
    "mtp-own-dtype": ("mtp", None, "auto", "fp8", True),
    "mtp-on-flashmla": ("mtp", "FLASHMLA_SPARSE", None, "fp8", False),
    "mtp-naming-fp8_ds_mla": ("mtp", None, "fp8_ds_mla", "fp8_e4m3", False),
    "eagle3-on-flashinfer": ("eagle3", FI, "auto", "fp8", False),
    "explicit-fp8_ds_mla": ("mtp", FI, None, "fp8_ds_mla", False),
    "bf16-cache": ("mtp", FI, None, "auto", False),
}


@pytest.mark.parametrize(
    ("method", "backend", "draft_dtype", "kv_cache_dtype", "refused"),
    list(MTP_DRAFTERS.values()),
    ids=list(MTP_DRAFTERS),
)
def test_nope_512_refused_where_mtp_drafter_cannot_share_fp8_ds_mla(
    method, backend, draft_dtype, kv_cache_dtype, refused, monkeypatch
):
    import vllm.config as cfg
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = backend and AttentionBackendEnum[backend]
    spec = SimpleNamespace(
        method=method, attention_backend=backend, kv_cache_dtype=draft_dtype
    )
    model = SimpleNamespace(hf_text_config=SimpleNamespace(qk_rope_head_dim=0))
    config = SimpleNamespace(model_config=model, speculative_config=spec)
    monkeypatch.setattr(cfg, "get_current_vllm_config", lambda: config)
    reason = _supports_combination(512, kv_cache_dtype, SM90)
    assert (reason is not None) == refused, reason


@pytest.mark.skipif(not current_platform.is_cuda(), reason="Requires CUDA backends")
def test_sm90_nope_fp8_ds_mla_resolves_to_flashmla():
    """The sparse backends ranked ahead of FLASHMLA_SPARSE for SM90 NoPE-512
    reject fp8_ds_mla, so the auto-selector lands on FlashMLA."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    order = _sparse_order("fp8_ds_mla", 512, num_heads=64, capability=SM90)
    for name in order[: order.index("FLASHMLA_SPARSE")]:
        backend_cls = AttentionBackendEnum[name].get_class()
        assert not backend_cls.supports_kv_cache_dtype("fp8_ds_mla"), name


@pytest.mark.skipif(not current_platform.is_cuda(), reason="Requires CUDA backends")
def test_sm100_576_bf16_low_heads_falls_back_from_fa4(monkeypatch):
    """With FA4 unusable, low-head bf16 selection lands on FlashInfer."""
    import vllm.v1.attention.backends.mla.flashattn_mla_sparse as fa4_sparse
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(fa4_sparse, "_fa4_cute_mla_available", lambda: "no FA4")

    def reasons(name):
        backend_cls = AttentionBackendEnum[name].get_class()
        return backend_cls.validate_configuration(
            head_size=576,
            dtype=torch.bfloat16,
            kv_cache_dtype="auto",
            block_size=64,
            use_mla=True,
            has_sink=False,
            use_sparse=True,
            use_mm_prefix=False,
            use_per_head_quant_scales=False,
            device_capability=SM100,
            attn_type="decoder",
        )

    order = _sparse_order("auto", 576, num_heads=16)
    with set_current_vllm_config(VllmConfig()):
        # The selector takes the first candidate with no rejection reasons.
        selected = next(name for name in order if not reasons(name))
    assert order[0] == "FLASH_ATTN_MLA_SPARSE_FA4", order
    assert selected == "FLASHINFER_MLA_SPARSE"
