"""The quantization stage: schemes (int8, fp8_block, w4a16, nvfp4, mxfp4, none) with their pure-torch references
(numerics.py, fp4.py and one module per scheme), layer selection (select.py), the aligned forward (aligned.py),
Triton kernels (triton_kernels.py) and the vLLM checkpoint writer (checkpoint.py). Heavy imports stay inside the
modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qarl_cli.config.quant import QuantConfig
    from qarl_cli.quant.base import Scheme


def build_scheme(cfg: "QuantConfig", device: str = "auto") -> "Scheme":
    """The scheme of `quant=cfg.name` for a rollout engine on `device` (auto, cpu or cuda)."""
    from qarl_cli.stages import resolve

    return resolve("quant", cfg.name)(cfg, device)
