# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Quantization config for the BF16 attention projections of GLM-5.3-Flash."""

from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.quantization.online.base import (
    OnlineQuantizationConfig,
)


def bf16_projection_quant_config(
    quant_config: QuantizationConfig | None,
) -> QuantizationConfig | None:
    """Return the quant config of the KDA, MLA and DSA indexer projections.

    Every checkpoint stores these projections in BF16, so the checkpoint's own
    method never applies to them; only explicitly requested online
    quantization does:

    - with a quantized checkpoint, the online config composed through
      ``--quantization-config`` (any form);
    - with a BF16 checkpoint (``--quantization online``), that config only when
      it names ``targets``, so the ``--quantization mxfp8`` / ``fp8_per_*``
      shorthands keep these projections BF16;
    - otherwise None.

    Projections that match no online target stay unquantized.
    """
    if isinstance(quant_config, OnlineQuantizationConfig):
        return quant_config if quant_config.args.targets is not None else None
    return quant_config.online_quantization_config if quant_config else None
