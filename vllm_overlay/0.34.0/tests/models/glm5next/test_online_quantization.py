# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Online quantization requested with `--quantization-config` reaches
GLM-5.3-Flash's BF16 attention projections (KDA, MLA, DSA indexer)."""

import pytest
import torch

from vllm.config import set_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.online.mxfp8 import (
    Mxfp8OnlineLinearMethod,
)
from vllm.models.glm5next.common.model import (
    Glm5NextDecoderLayer,
    _try_load_fp8_attn_proj,
)
from vllm.platforms import current_platform
from vllm.utils.torch_utils import set_default_torch_dtype

# dist_init (under `distributed`) already tears down the process group and
# collects garbage after each test; upstream's global cleanup would repeat it.
pytestmark = [
    pytest.mark.usefixtures("distributed", "gpu_stubs"),
    pytest.mark.skip_global_cleanup,
]

# Z.ai's FP8 checkpoint: block-FP8 linears and experts, BF16 attention.
BLOCK_FP8 = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
}
# The attention projections of the recommended all-projection regex.
TARGETS = {
    "targets": {
        "re:.*[.]self_attn[.](in_proj_qkvbfg_a|o_proj|fused_qkv_a_proj|q_b_proj|"
        "indexer[.]wq_b)": "mxfp8"
    }
}
LINEAR = {"linear": "mxfp8"}

# case: (checkpoint's quantization_config, --quantization, --quantization-config)
CASES = {
    "checkpoint+targets": (BLOCK_FP8, "fp8", TARGETS),
    "checkpoint+linear": (BLOCK_FP8, "fp8", LINEAR),
    "online+targets": (None, "online", TARGETS),
    "online+linear": (None, "online", LINEAR),
    "mxfp8-shorthand": (None, "mxfp8", None),
    "online+moe": (None, "online", {"moe": "mxfp8"}),
    "bf16": (None, None, None),
}
# BF16 checkpoint cases without `targets`: whether a `linear` config would
# have reached the projections, so a warning says how to name them.
KEEPS_BF16_WARNS = {
    "online+linear": True,
    "mxfp8-shorthand": True,
    "online+moe": False,
    "bf16": False,
}

# GLM-5.3-Flash's layers 0-2 are KDA, layer 3 the first MLA, then every 4th.
LAYERS = {"kda": 0, "mla": 3}
PROJECTIONS = {
    "kda": ("in_proj_qkvbfg_a", "f_b_proj", "g_b_proj", "o_proj"),
    "mla": ("fused_qkv_a_proj", "q_b_proj", "o_proj", "indexer.wq_b", "kv_b_proj"),
}
# kv_b_proj is absorbed into the W_UK/W_UV weights after loading: never
# quantized. TARGETS leaves out the KDA gate projections (K=128).
UNQUANTIZED = {
    "linear": {"kv_b_proj"},
    "targets": {"kv_b_proj", "f_b_proj", "g_b_proj"},
}


def build_layer(vllm_config, layer_idx: int, device: str = "meta"):
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device(device),
    ):
        return Glm5NextDecoderLayer(
            vllm_config=vllm_config,
            config=vllm_config.model_config.hf_text_config,
            layer_idx=layer_idx,
            prefix=f"model.layers.{layer_idx}",
        )


def make_case_config(make_vllm_config, case: str):
    checkpoint, quantization, quantization_config = CASES[case]
    return make_vllm_config(
        checkpoint, quantization=quantization, quantization_config=quantization_config
    )


def quant_methods(module, names) -> dict[str, type]:
    return {n: type(module.get_submodule(n).quant_method) for n in names}


@pytest.mark.parametrize("kind", list(PROJECTIONS))
@pytest.mark.parametrize(
    "case", ["checkpoint+targets", "checkpoint+linear", "online+targets"]
)
def test_online_config_reaches_attention_projections(case, kind, make_vllm_config):
    """`targets` quantizes the projections it names whichever the checkpoint;
    `linear` reaches them only when composed with a quantized checkpoint."""
    layer = build_layer(make_case_config(make_vllm_config, case), LAYERS[kind])

    unquantized = UNQUANTIZED[case.split("+")[1]]
    assert quant_methods(layer.self_attn, PROJECTIONS[kind]) == {
        n: UnquantizedLinearMethod if n in unquantized else Mxfp8OnlineLinearMethod
        for n in PROJECTIONS[kind]
    }


@pytest.mark.parametrize("case", list(KEEPS_BF16_WARNS))
def test_bf16_checkpoint_without_targets_keeps_attention_projections_bf16(
    case, make_vllm_config, caplog_vllm, monkeypatch
):
    """With a BF16 checkpoint and no `targets`, the projections stay BF16, as
    before; a `linear` config that would have reached them logs how to name
    them."""
    # The model's quant-config logger; each case needs its own warning record.
    logger = init_logger("vllm.models.glm5next.quant_config")
    monkeypatch.setattr(logger, "warning_once", logger.warning)
    for kind, layer_idx in LAYERS.items():
        layer = build_layer(make_case_config(make_vllm_config, case), layer_idx)
        assert set(quant_methods(layer.self_attn, PROJECTIONS[kind]).values()) == {
            UnquantizedLinearMethod
        }

    warnings = [
        r.getMessage() for r in caplog_vllm.records if "stay BF16" in r.getMessage()
    ]
    assert bool(warnings) is KEEPS_BF16_WARNS[case], warnings
    assert all("--quantization online with targets naming them" in w for w in warnings)


@pytest.mark.parametrize(
    "projection, checkpoint_shards",
    [
        ("q_b_proj", ("q_b_proj",)),
        ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
    ],
    ids=["q_b_proj", "fused_qkv_a_proj"],
)
def test_fp8_mla_weights_reach_online_target_as_bf16(
    projection, checkpoint_shards, make_vllm_config
):
    """FP8 checkpoint weights are dequantized at load, then quantized by the
    online method exactly as their BF16 dequantization would be."""
    vllm_config = make_case_config(make_vllm_config, "checkpoint+targets")
    device = current_platform.device_type
    fp8_idx, bf16_idx = LAYERS["mla"], LAYERS["mla"] + 4
    from_fp8 = build_layer(vllm_config, fp8_idx, device)
    want = build_layer(vllm_config, bf16_idx, device).self_attn.get_submodule(
        projection
    )

    prefix = f"model.layers.{fp8_idx}"
    fp8_params = {f"{prefix}.{n}": p for n, p in from_fp8.named_parameters()}
    pending: dict = {}
    cols = want.input_size
    torch.manual_seed(0)
    for shard_id, shard in enumerate(checkpoint_shards):
        rows = getattr(want, "output_sizes", [want.output_size])[shard_id]
        weight = (torch.randn(rows, cols) * 64).to(torch.float8_e4m3fn)
        scale_inv = torch.rand(-(-rows // 128), -(-cols // 128)) / 512 + 1 / 1024
        for suffix, tensor in (("weight", weight), ("weight_scale_inv", scale_inv)):
            name = f"{prefix}.self_attn.{shard}.{suffix}"
            # kv_a_pad_size=0: GLM-5.3-Flash's MLA has no RoPE dimensions.
            assert _try_load_fp8_attn_proj(
                name, tensor.to(device), pending, fp8_params, set(), 0
            ), name
        scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
        bf16 = (weight.float() * scale[:rows, :cols]).to(torch.bfloat16)
        shard_args = (shard_id,) if len(checkpoint_shards) > 1 else ()
        want.weight.weight_loader(want.weight, bf16.to(device), *shard_args)

    got = from_fp8.self_attn.get_submodule(projection)
    assert got.weight.dtype != torch.bfloat16, f"{projection} weight never quantized"
    assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert torch.equal(
        got.weight_scale.view(torch.uint8), want.weight_scale.view(torch.uint8)
    )


def test_online_target_on_mla_attention_is_rejected(make_vllm_config):
    """A target matching the MLA attention module itself fails at startup, as
    for DeepSeek-V2, instead of being silently ignored."""
    vllm_config = make_vllm_config(
        quantization="online",
        quantization_config={"targets": {"re:.*[.]self_attn[.]attn": "mxfp8"}},
    )
    with pytest.raises(
        ValueError, match="online quantization is not supported for MLAAttention"
    ):
        build_layer(vllm_config, LAYERS["mla"])
