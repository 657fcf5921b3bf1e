# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`--kv-cache-dtype fp8` for GLM-5.3-Flash on Hopper: which cache rows
`Glm5NextModelConfig` asks for (CPU; the device is mocked as SM90)."""

from collections.abc import Callable
from pathlib import Path

import pytest

from vllm.model_executor.models.config import Glm5NextModelConfig
from vllm.platforms import current_platform

from .conftest import create_vllm_config, write_model_dir


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_model_dir(tmp_path / "glm-5.3-flash")


@pytest.fixture
def after_hook_on_sm90(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[..., tuple[str, str | None]]:
    """Builds a config on this host, then runs the model's config hook as on
    an SM90 GPU; returns the target's and the drafter's cache dtype."""

    def run(model_dir: Path, **engine_args) -> tuple[str, str | None]:
        vllm_config = create_vllm_config(model_dir, **engine_args)
        with monkeypatch.context() as m:
            m.setattr(current_platform, "is_cuda", lambda: True)
            m.setattr(
                current_platform,
                "is_device_capability_family",
                lambda family: family == 90,
            )
            Glm5NextModelConfig.verify_and_update_config(vllm_config)
        spec_config = vllm_config.speculative_config
        return (
            vllm_config.cache_config.cache_dtype,
            spec_config.kv_cache_dtype if spec_config else None,
        )

    return run


MTP = {"method": "mtp", "num_speculative_tokens": 1}


def test_fp8_selects_fp8_ds_mla_rows(after_hook_on_sm90, model_dir: Path) -> None:
    assert after_hook_on_sm90(model_dir, kv_cache_dtype="fp8")[0] == "fp8_ds_mla"


def test_mtp_drafter_shares_fp8_ds_mla_rows(
    after_hook_on_sm90, model_dir: Path
) -> None:
    target, drafter = after_hook_on_sm90(
        model_dir, kv_cache_dtype="fp8", speculative_config=MTP
    )
    assert (target, drafter) == ("fp8_ds_mla", None)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_ds_mla"])
def test_other_cache_dtypes_are_kept(
    after_hook_on_sm90, model_dir: Path, kv_cache_dtype: str
) -> None:
    target, _ = after_hook_on_sm90(model_dir, kv_cache_dtype=kv_cache_dtype)
    assert target == kv_cache_dtype


def test_drafter_pinned_to_flashinfer_keeps_per_tensor_fp8(
    after_hook_on_sm90, model_dir: Path
) -> None:
    spec = MTP | {"attention_backend": "FLASHINFER_MLA_SPARSE_SM90"}
    target, _ = after_hook_on_sm90(
        model_dir, kv_cache_dtype="fp8", speculative_config=spec
    )
    assert target == "fp8"


def test_target_on_flashmla_with_flashinfer_drafter_is_an_error(
    after_hook_on_sm90, model_dir: Path
) -> None:
    spec = MTP | {"attention_backend": "FLASHINFER_MLA_SPARSE_SM90"}
    with pytest.raises(ValueError, match="Choose FLASHMLA_SPARSE for both"):
        after_hook_on_sm90(
            model_dir,
            kv_cache_dtype="fp8",
            attention_backend="FLASHMLA_SPARSE",
            speculative_config=spec,
        )


def test_mtp_drafter_asking_for_fp8_e4m3_keeps_per_tensor_fp8(
    after_hook_on_sm90, model_dir: Path
) -> None:
    spec = MTP | {"kv_cache_dtype": "fp8_e4m3"}
    target, drafter = after_hook_on_sm90(
        model_dir, kv_cache_dtype="fp8", speculative_config=spec
    )
    assert (target, drafter) == ("fp8", "fp8_e4m3")


def test_dcp_with_too_many_heads_per_rank_keeps_per_tensor_fp8(
    after_hook_on_sm90, model_dir: Path
) -> None:
    # FlashMLA sparse runs DCP over fp8 rows only below 32 heads per rank;
    # GLM-5.3-Flash has 32 at TP 2.
    target, _ = after_hook_on_sm90(
        model_dir,
        kv_cache_dtype="fp8",
        tensor_parallel_size=2,
        decode_context_parallel_size=2,
    )
    assert target == "fp8"


def test_fp8_is_unchanged_off_hopper(model_dir: Path) -> None:
    vllm_config = create_vllm_config(model_dir, kv_cache_dtype="fp8")
    Glm5NextModelConfig.verify_and_update_config(vllm_config)
    assert vllm_config.cache_config.cache_dtype == "fp8"
