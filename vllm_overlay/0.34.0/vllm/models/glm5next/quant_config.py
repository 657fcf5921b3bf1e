# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Quantization config for the BF16 attention projections of GLM-5.3-Flash."""

from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.quantization.online.base import (
    OnlineQuantizationConfig,
)

logger = init_logger(__name__)

# A `targets` key naming the attention projections (the KDA gate projections
# and kv_b_proj aside), as in the GLM-5.3-Flash recipes.
ATTENTION_PROJECTIONS_TARGET = (
    "re:.*[.]self_attn[.](in_proj_qkvbfg_a|o_proj|fused_qkv_a_proj|q_b_proj|"
    "indexer[.]wq_b)"
)


def bf16_projection_quant_config(
    vllm_config: VllmConfig,
) -> QuantizationConfig | None:
    """Return the quant config of the KDA, MLA and DSA indexer projections.

    The model runs these projections in BF16: the KDA and indexer ones are
    BF16 in every checkpoint, and the block-FP8 MLA ones of the Z.ai FP8
    checkpoint are dequantized at load (`_try_load_fp8_attn_proj`). So the
    checkpoint's own method never applies to them; only explicitly requested
    online quantization does:

    - with a quantized checkpoint, the online config composed through
      ``--quantization-config``, in any form (``linear``, said once at
      startup, or ``targets``);
    - with a BF16 checkpoint, the online config only when it names
      ``targets``; ``linear``, from ``--quantization online`` or a shorthand
      such as ``--quantization mxfp8``, leaves them BF16 (with a warning);
    - otherwise None.
    """
    quant_config = vllm_config.quant_config
    if quant_config is None:
        return None
    if not isinstance(quant_config, OnlineQuantizationConfig):
        online = quant_config.online_quantization_config
        if online is not None and online.args.targets is None:
            logger.info_once(
                "GLM-5.3-Flash: online quantization's linear scheme also reaches "
                "the KDA, MLA and DSA-indexer attention projections of this "
                "quantized checkpoint; name targets instead of linear to keep "
                "them BF16."
            )
        return online
    if quant_config.args.targets is not None:
        return quant_config
    if quant_config.args.linear is not None:
        logger.warning_once(
            "GLM-5.3-Flash: the KDA, MLA and DSA-indexer attention projections "
            "stay BF16, as before: with a BF16 checkpoint, online quantization "
            "reaches them only through quantization_config.targets, not linear. "
            "To quantize them, pass --quantization online with targets naming "
            "them (targets replaces linear: name the other layers to quantize "
            "too), e.g. %r.",
            ATTENTION_PROJECTIONS_TARGET,
        )
    return None
