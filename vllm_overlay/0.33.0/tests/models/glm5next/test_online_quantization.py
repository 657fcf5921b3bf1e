# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
import pytest
import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.online.mxfp8 import (
    Mxfp8OnlineLinearMethod,
)
from vllm.models.glm5next.common.model import _try_load_fp8_attn_proj
from vllm.platforms import current_platform

pytestmark = pytest.mark.skip_global_cleanup  # dist_init cleans up after each test
# Z.ai's FP8 checkpoint: block-FP8 linears and experts, BF16 attention.
FP8 = dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128] * 2)
# The attention projections of the recommended all-projection regex.
ATTENTION = "in_proj_qkvbfg_a|o_proj|fused_qkv_a_proj|q_b_proj|indexer[.]wq_b"
TARGETS = {"targets": {f"re:.*[.]self_attn[.]({ATTENTION})": "mxfp8"}}
# case: (checkpoint's quantization_config, --quantization, --quantization-config)
CASES = {
    "checkpoint+targets": (FP8, "fp8", TARGETS),
    "checkpoint+linear": (FP8, "fp8", {"linear": "mxfp8"}),
    "online+targets": (None, "online", TARGETS),
    # BF16 checkpoint, no targets
    "online+linear": (None, "online", {"linear": "mxfp8"}),
    "mxfp8-shorthand": (None, "mxfp8", None),
    "online+moe": (None, "online", {"moe": "mxfp8"}),
    "bf16": (None, None, None),
}
# Layer 0 is KDA, 3 the first MLA. TARGETS leaves out the KDA gates (K=128);
# kv_b_proj, absorbed into W_UK/W_UV after loading, is never quantized.
PROJECTIONS = {
    0: ("in_proj_qkvbfg_a", "f_b_proj", "g_b_proj", "o_proj"),
    3: ("fused_qkv_a_proj", "q_b_proj", "o_proj", "indexer.wq_b", "kv_b_proj"),
}
KEPT_BF16 = {"targets": {"kv_b_proj", "f_b_proj", "g_b_proj"}, "linear": {"kv_b_proj"}}
FUSED = {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}


def quant_methods(attn, layer_idx) -> dict[str, type]:
    return {n: type(attn.get_submodule(n).quant_method) for n in PROJECTIONS[layer_idx]}


@pytest.mark.parametrize("layer_idx", PROJECTIONS, ids=["kda", "mla"])
@pytest.mark.parametrize("case", list(CASES)[:3])
def test_online_config_reaches_attention_projections(case, layer_idx, glm5_flash_attn):
    """`targets` whatever the checkpoint, `linear` composed with one, reach them."""
    kept_bf16 = KEPT_BF16[case.split("+")[1]]
    assert quant_methods(glm5_flash_attn(layer_idx, *CASES[case]), layer_idx) == {
        n: UnquantizedLinearMethod if n in kept_bf16 else Mxfp8OnlineLinearMethod
        for n in PROJECTIONS[layer_idx]
    }


@pytest.mark.parametrize("case", list(CASES)[3:])
def test_bf16_checkpoint_without_targets_keeps_attention_projections_bf16(
    case, glm5_flash_attn, caplog_vllm, monkeypatch
):
    """They stay BF16, as before; a `linear` config that misses them logs a hint."""
    logger = init_logger("vllm.models.glm5next.quant_config")
    monkeypatch.setattr(logger, "warning_once", logger.warning)  # one per case
    for i in PROJECTIONS:
        methods = quant_methods(glm5_flash_attn(i, *CASES[case]), i)
        assert set(methods.values()) == {UnquantizedLinearMethod}
    warned = "pass --quantization online with targets" in caplog_vllm.text
    assert warned is (case in ("online+linear", "mxfp8-shorthand"))


@pytest.mark.parametrize("case", list(CASES)[:2])
def test_checkpoint_with_linear_says_it_reaches_attention_projections(
    case, glm5_flash_attn, caplog_vllm, monkeypatch
):
    logger = init_logger("vllm.models.glm5next.quant_config")
    monkeypatch.setattr(logger, "info_once", logger.info)  # one per case
    glm5_flash_attn(0, *CASES[case])
    said = "linear scheme also reaches the KDA, MLA" in caplog_vllm.text
    assert said is (case == "checkpoint+linear")


@pytest.mark.parametrize("projection", ["q_b_proj", "fused_qkv_a_proj"])
def test_fp8_mla_weights_reach_online_target_as_bf16(projection, glm5_flash_attn):
    """Block-FP8 MLA weights are dequantized, then online-quantized as BF16 ones."""
    args = (3, *CASES["checkpoint+targets"], current_platform.device_type)
    got, want = (glm5_flash_attn(*args).get_submodule(projection) for _ in range(2))
    params = dict(got.named_parameters(prefix=f"attn.{projection}"))
    buf: dict = {}
    bf16 = []
    torch.manual_seed(0)
    shards = FUSED.get(projection, [projection])
    for shard, rows in zip(shards, want.output_partition_sizes):
        weight = (torch.randn(rows, want.input_size) * 64).to(torch.float8_e4m3fn)
        scale_inv = torch.rand(rows // 128, want.input_size // 128) / 512 + 1 / 1024
        for suffix, t in (("weight", weight), ("weight_scale_inv", scale_inv)):
            n = f"attn.{shard}.{suffix}"
            assert _try_load_fp8_attn_proj(n, t, buf, params, set(), kv_a_pad_size=0)
        scale = torch.kron(scale_inv, torch.ones(128, 128))
        bf16.append((weight.float() * scale).to(torch.bfloat16))
    want.weight.weight_loader(want.weight, torch.cat(bf16))
    assert got.weight.dtype != torch.bfloat16, "never quantized"
    for a, b in ((got.weight, want.weight), (got.weight_scale, want.weight_scale)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_online_target_on_mla_attention_is_rejected(glm5_flash_attn):
    """A target naming the MLA attention itself fails at startup, as on DeepSeek."""
    targets = {"targets": {"re:.*[.]self_attn[.]attn": "mxfp8"}}
    with pytest.raises(ValueError, match="not supported for MLAAttention"):
        glm5_flash_attn(3, None, "online", targets)
