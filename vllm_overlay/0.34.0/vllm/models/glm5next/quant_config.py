# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Quantization config for the BF16 attention projections of GLM-5.3-Flash."""

from vllm.config import VllmConfig
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.quantization.online.base import (
    OnlineQuantizationConfig,
)


def bf16_projection_quant_config(
    vllm_config: VllmConfig,
) -> QuantizationConfig | None:
    """Return the quant config of the KDA, MLA and DSA indexer projections.

    Every checkpoint stores these projections in BF16, so the checkpoint's own
    method never applies to them; only explicitly requested online
    quantization does, in any form (``linear`` or ``targets``):

    - with a quantized checkpoint, the online config composed through
      ``--quantization-config``;
    - with a BF16 checkpoint, the config of ``--quantization online``; the
      ``--quantization mxfp8`` / ``fp8_per_*`` shorthands keep them BF16;
    - otherwise None.
    """
    quant_config = vllm_config.quant_config
    if isinstance(quant_config, OnlineQuantizationConfig):
        explicit = vllm_config.model_config.quantization == "online"
        return quant_config if explicit else None
    return quant_config.online_quantization_config if quant_config else None
