# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Online quantization requested with `--quantization-config` reaches
GLM-5.3-Flash's BF16 attention projections (KDA, MLA, DSA indexer)."""

import pytest
import torch

from vllm.config import set_current_vllm_config
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

# The attention projections of the recommended all-projection regex.
TARGETS = {
    "targets": {
        "re:.*[.]self_attn[.](in_proj_qkvbfg_a|o_proj|fused_qkv_a_proj|q_b_proj|"
        "indexer[.]wq_b)": "mxfp8"
    }
}
LINEAR = {"linear": "mxfp8"}

# case: (checkpoint, --quantization, --quantization-config)
CASES = {
    "checkpoint+targets": ("block-fp8", "fp8", TARGETS),
    "checkpoint+linear": ("block-fp8", "fp8", LINEAR),
    "online+targets": ("bf16", "online", TARGETS),
    "online+linear": ("bf16", "online", LINEAR),
}

PROJECTIONS = {
    "deepseek_sparse_attention": (
        "fused_qkv_a_proj",
        "q_b_proj",
        "o_proj",
        "indexer.wq_b",
        "kv_b_proj",
    ),
    "linear_attention": ("in_proj_qkvbfg_a", "f_b_proj", "g_b_proj", "o_proj"),
}
# kv_b_proj is absorbed into the W_UK/W_UV weights after loading: never
# quantized. TARGETS leaves out the KDA gate projections (K=128).
UNQUANTIZED = {
    "linear": {"kv_b_proj"},
    "targets": {"kv_b_proj", "f_b_proj", "g_b_proj"},
}


def build_layer(
    vllm_config, layer_idx: int, device: str, **kwargs
) -> Glm5NextDecoderLayer:
    config = vllm_config.model_config.hf_text_config
    with (
        set_current_vllm_config(vllm_config),
        set_default_torch_dtype(vllm_config.model_config.dtype),
        torch.device(device),
    ):
        return Glm5NextDecoderLayer(
            vllm_config=vllm_config,
            config=config,
            layer_idx=layer_idx,
            prefix=f"model.layers.{layer_idx}",
            **kwargs,
        )


def layers_of_type(glm5_flash_config, layer_type: str) -> list[int]:
    layer_types = glm5_flash_config["layer_types"]
    return [i for i, t in enumerate(layer_types) if t == layer_type]


def quant_methods(module, names) -> dict[str, type]:
    return {n: type(module.get_submodule(n).quant_method) for n in names}


@pytest.mark.parametrize("layer_type", list(PROJECTIONS))
@pytest.mark.parametrize("case", list(CASES))
def test_online_config_reaches_attention_projections(
    case, layer_type, glm5_flash_config, make_glm5_flash_vllm_config
):
    """`linear` and `targets` quantize the same projections whichever the
    checkpoint: block-FP8 (composed) or BF16 (`--quantization online`)."""
    vllm_config = make_glm5_flash_vllm_config(*CASES[case])
    layer_idx = layers_of_type(glm5_flash_config, layer_type)[0]
    attn = build_layer(vllm_config, layer_idx, device="meta").self_attn

    unquantized = UNQUANTIZED[case.split("+")[1]]
    assert quant_methods(attn, PROJECTIONS[layer_type]) == {
        n: UnquantizedLinearMethod if n in unquantized else Mxfp8OnlineLinearMethod
        for n in PROJECTIONS[layer_type]
    }


def test_quantization_shorthand_keeps_attention_projections_bf16(
    glm5_flash_config, make_glm5_flash_vllm_config
):
    """`--quantization mxfp8` quantizes the MLPs and, as before, none of these
    projections; `--quantization online` with the same scheme reaches them."""
    layer_idx = layers_of_type(glm5_flash_config, "linear_attention")[0]
    shorthand = build_layer(
        make_glm5_flash_vllm_config("bf16", "mxfp8"), layer_idx, "meta"
    )
    explicit = build_layer(
        make_glm5_flash_vllm_config(*CASES["online+linear"]), layer_idx, "meta"
    )

    names = PROJECTIONS["linear_attention"]
    assert type(shorthand.mlp.down_proj.quant_method) is Mxfp8OnlineLinearMethod
    assert quant_methods(shorthand.self_attn, names) == {
        n: UnquantizedLinearMethod for n in names
    }
    assert quant_methods(explicit.self_attn, names) == {
        n: Mxfp8OnlineLinearMethod for n in names
    }


def random_block_fp8(shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 checkpoint weight and its per-128x128 `weight_scale_inv`."""
    weight = (torch.randn(shape) * 64).to(torch.float8_e4m3fn)
    blocks = (-(-shape[0] // 128), -(-shape[1] // 128))
    return weight, torch.rand(blocks) / 512 + 1 / 1024


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor):
    rows, cols = weight.shape
    scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return (weight.float() * scale[:rows, :cols]).to(torch.bfloat16)


@pytest.mark.parametrize(
    "projection, checkpoint_shards",
    [
        ("q_b_proj", ("q_b_proj",)),
        ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")),
    ],
    ids=["q_b_proj", "fused_qkv_a_proj"],
)
def test_fp8_mla_weights_reach_online_target_as_bf16(
    projection, checkpoint_shards, glm5_flash_config, make_glm5_flash_vllm_config
):
    """FP8 checkpoint weights are dequantized at load, then quantized by the
    online method exactly as their BF16 dequantization would be."""
    vllm_config = make_glm5_flash_vllm_config("block-fp8", "fp8", TARGETS)
    config = vllm_config.model_config.hf_text_config
    shapes = {
        "q_b_proj": (
            config.num_attention_heads * config.qk_head_dim,
            config.q_lora_rank,
        ),
        "q_a_proj": (config.q_lora_rank, config.hidden_size),
        "kv_a_proj_with_mqa": (config.kv_lora_rank, config.hidden_size),
    }
    kv_a_pad_size = config.qk_rope_head_dim if config.mla_use_nope else 0
    mla_layers = layers_of_type(glm5_flash_config, "deepseek_sparse_attention")
    from_fp8_idx, from_bf16_idx = mla_layers[:2]
    device = current_platform.device_type
    from_fp8 = build_layer(vllm_config, from_fp8_idx, device)
    from_bf16 = build_layer(vllm_config, from_bf16_idx, device)

    fp8_prefix = f"model.layers.{from_fp8_idx}"
    fp8_params = {f"{fp8_prefix}.{n}": p for n, p in from_fp8.named_parameters()}
    bf16_params = dict(from_bf16.named_parameters())
    pending: dict = {}
    torch.manual_seed(0)
    for shard_id, shard in enumerate(checkpoint_shards):
        weight, scale_inv = random_block_fp8(shapes[shard])
        for suffix, tensor in (("weight", weight), ("weight_scale_inv", scale_inv)):
            name = f"{fp8_prefix}.self_attn.{shard}.{suffix}"
            loaded = _try_load_fp8_attn_proj(
                name, tensor.to(device), pending, fp8_params, set(), kv_a_pad_size
            )
            assert loaded, name

        param = bf16_params[f"self_attn.{projection}.weight"]
        shard_args = (shard_id,) if len(checkpoint_shards) > 1 else ()
        bf16_weight = dequantize_block_fp8(weight, scale_inv).to(device)
        param.weight_loader(param, bf16_weight, *shard_args)

    got = from_fp8.self_attn.get_submodule(projection)
    want = from_bf16.self_attn.get_submodule(projection)
    assert got.weight.dtype != torch.bfloat16, f"{projection} weight never quantized"
    assert got.weight.dtype == want.weight.dtype
    assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert torch.equal(
        got.weight_scale.view(torch.uint8), want.weight_scale.view(torch.uint8)
    )


def test_online_target_on_mla_attention_is_rejected(
    glm5_flash_config, make_glm5_flash_vllm_config
):
    """A target matching the MLA attention module itself fails at startup, as
    for DeepSeek-V2, instead of being silently ignored."""
    vllm_config = make_glm5_flash_vllm_config(
        "bf16", "online", {"targets": {"re:.*[.]self_attn[.]attn": "mxfp8"}}
    )
    layer_idx = layers_of_type(glm5_flash_config, "deepseek_sparse_attention")[0]
    with pytest.raises(
        ValueError, match="online quantization is not supported for MLAAttention"
    ):
        build_layer(vllm_config, layer_idx, device="meta")
