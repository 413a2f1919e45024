"""Rounding and scale rules shared by the schemes' pure-torch references (docs/design.md, "Quantization schemes").

Every rounding is round-to-nearest-even: `torch.round` for integers, torch's cast for float8_e4m3fn (both RTNE).
Divisions by a constant go through `div_rn`: on CUDA, torch divides by a Python scalar as a multiplication by its
reciprocal, which is one ulp off now and then and flips a rounding at a boundary; tensor / tensor is IEEE."""

from __future__ import annotations

import importlib.util

import torch

INT8_MAX = 127
INT4_MIN, INT4_MAX = -8, 7
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-12  # never divide by zero (an all-zero row or block gets this scale and quantizes to 0)
# vLLM's per_token_group_fp8_quant floors each group's amax here (not the scale): the fp8 activation reference
# follows the engine.
FP8_ACT_AMAX_EPS = 1e-10


def div_rn(a: torch.Tensor, b: float | torch.Tensor) -> torch.Tensor:
    """a / b correctly rounded on every device (see the module docstring)."""
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    return a / b


def absmax_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Symmetric scale amax / qmax in fp32, floored at SCALE_FLOOR."""
    return div_rn(amax.float(), float(qmax)).clamp_min(SCALE_FLOOR)


def round_int(x: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """RTNE to integers, saturated to [qmin, qmax], as int8."""
    return torch.round(x).clamp(qmin, qmax).to(torch.int8)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """RTNE to float8_e4m3fn, saturated at +-448 (e4m3fn has no infinity)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def group_view(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., K] -> [..., K // group, group]; K must be a multiple of group."""
    k = x.shape[-1]
    if k % group:
        raise ValueError(f"the last dimension ({k}) must be a multiple of the group size {group}")
    return x.reshape(*x.shape[:-1], k // group, group)


def use_triton(x: torch.Tensor) -> bool:
    """Triton kernels run compiled on CUDA tensors; elsewhere the pure-torch reference runs (the kernels equal it
    bit for bit; tests run them on CPU under TRITON_INTERPRET=1)."""
    return x.is_cuda and importlib.util.find_spec("triton") is not None
