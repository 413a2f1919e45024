"""quant=none: rollouts and training in the model's dtype. The identity scheme: nothing is selected for the
aligned forward, and `qarl quantize quant=none` writes the weights unchanged."""

from __future__ import annotations

from typing import Optional

import torch

from qarl_cli.quant.base import Packed, SchemeBase


class NoQuantScheme(SchemeBase):
    name = "none"
    quantizes_weights = False
    quantizes_activations = False

    def quantize(self, w: torch.Tensor) -> Packed:
        return {"weight": w}

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        return packed["weight"].to(dtype)

    def quantization_config(self, ignore: list[str]) -> Optional[dict]:
        return None
