# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`--kv-cache-dtype fp8` for GLM-5.3-Flash on Hopper: which cache rows
`Glm5NextModelConfig` asks for (CPU; the device is mocked as SM90)."""

from collections.abc import Callable

import pytest

from vllm.model_executor.models.config import Glm5NextModelConfig
from vllm.platforms import current_platform

MTP = {"method": "mtp", "num_speculative_tokens": 1}
FLASHINFER_MTP = MTP | {"attention_backend": "FLASHINFER_MLA_SPARSE_SM90"}


@pytest.fixture
def cache_dtypes_on_sm90(
    make_vllm_config, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., tuple[str, str | None]]:
    """Builds a config on this host, then runs the model's config hook as on
    an SM90 GPU; returns the target's and the drafter's cache dtype."""

    def run(**engine_args) -> tuple[str, str | None]:
        vllm_config = make_vllm_config(**engine_args)
        with monkeypatch.context() as m:
            m.setattr(current_platform, "is_cuda", lambda: True)
            m.setattr(
                current_platform, "is_device_capability_family", lambda f: f == 90
            )
            Glm5NextModelConfig.verify_and_update_config(vllm_config)
        spec_config = vllm_config.speculative_config
        return (
            vllm_config.cache_config.cache_dtype,
            spec_config.kv_cache_dtype if spec_config else None,
        )

    return run


def test_fp8_selects_fp8_ds_mla_rows(cache_dtypes_on_sm90) -> None:
    assert cache_dtypes_on_sm90(kv_cache_dtype="fp8")[0] == "fp8_ds_mla"


def test_mtp_drafter_shares_fp8_ds_mla_rows(cache_dtypes_on_sm90) -> None:
    dtypes = cache_dtypes_on_sm90(kv_cache_dtype="fp8", speculative_config=MTP)
    assert dtypes == ("fp8_ds_mla", None)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_ds_mla"])
def test_other_cache_dtypes_are_kept(cache_dtypes_on_sm90, kv_cache_dtype) -> None:
    assert cache_dtypes_on_sm90(kv_cache_dtype=kv_cache_dtype)[0] == kv_cache_dtype


def test_drafter_pinned_to_flashinfer_keeps_per_tensor_fp8(
    cache_dtypes_on_sm90,
) -> None:
    dtypes = cache_dtypes_on_sm90(
        kv_cache_dtype="fp8", speculative_config=FLASHINFER_MTP
    )
    assert dtypes[0] == "fp8"


def test_target_on_flashmla_with_flashinfer_drafter_is_an_error(
    cache_dtypes_on_sm90,
) -> None:
    with pytest.raises(ValueError, match="Choose FLASHMLA_SPARSE for both"):
        cache_dtypes_on_sm90(
            kv_cache_dtype="fp8",
            attention_backend="FLASHMLA_SPARSE",
            speculative_config=FLASHINFER_MTP,
        )


def test_mtp_drafter_asking_for_fp8_e4m3_keeps_per_tensor_fp8(
    cache_dtypes_on_sm90,
) -> None:
    spec = MTP | {"kv_cache_dtype": "fp8_e4m3"}
    dtypes = cache_dtypes_on_sm90(kv_cache_dtype="fp8", speculative_config=spec)
    assert dtypes == ("fp8", "fp8_e4m3")


def test_dcp_with_too_many_heads_per_rank_keeps_per_tensor_fp8(
    cache_dtypes_on_sm90,
) -> None:
    # FlashMLA sparse runs DCP over fp8 rows only below 32 heads per rank;
    # GLM-5.3-Flash has 32 at TP 2.
    dtypes = cache_dtypes_on_sm90(
        kv_cache_dtype="fp8", tensor_parallel_size=2, decode_context_parallel_size=2
    )
    assert dtypes[0] == "fp8"


def test_fp8_is_unchanged_off_hopper(make_vllm_config) -> None:
    vllm_config = make_vllm_config(kv_cache_dtype="fp8")
    Glm5NextModelConfig.verify_and_update_config(vllm_config)
    assert vllm_config.cache_config.cache_dtype == "fp8"
