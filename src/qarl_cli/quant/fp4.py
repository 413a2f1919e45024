"""The E2M1 element format that nvfp4 and mxfp4 share: rounding onto its grid, the 4-bit codes, their packing two
to a byte, and decoding. The block scales are each format's own (nvfp4.py, mxfp4.py).

E2M1 holds +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; a code is the sign in bit 3 and the index into that grid in bits 0-2.
Rounding is round-to-nearest-even after saturating at +-6: the grid's spacing is 0.5 below 2, 1 from 2 to 4 and
2 from 4 to 6, so each range rounds with torch.round (RTNE) at its own spacing; a tie goes to the value whose
mantissa bit is 0 (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). These are the
thresholds of vLLM's `cast_to_fp4` (model_executor/layers/quantization/utils/nvfp4_emulation_utils.py) and of
compressed-tensors' `FP4_E2M1_DATA.cast_to_fp4`.

The sign bit is the scaled value's sign bit, so a negative value that rounds to 0 gives the code of -0 (8), as
compressed-tensors' `pack_fp4_to_uint8` (compressors/nvfp4/helpers.py) and vLLM's Triton `_compute_quant_and_scale`
(utils/mxfp4_utils.py) both write it. Packing follows `pack_fp4_to_uint8`: element 2i in the low nibble of byte
i, element 2i+1 in the high nibble."""

from __future__ import annotations

import torch

from qarl_cli.quant.numerics import E4M3_MAX, div_rn

E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """fp32 y -> the uint8 E2M1 codes of RTNE(clamp(y, -6, 6))."""
    m = y.float().abs().clamp_max(E2M1_MAX)
    v = torch.where(m < 2, torch.round(m * 2) / 2, torch.where(m < 4, torch.round(m), 2 * torch.round(m / 2)))
    index = torch.where(v < 2, v * 2, torch.where(v < 4, v + 2, 6 + (v == E2M1_MAX).float()))
    return index.to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> their fp32 values (-0.0 for code 8)."""
    grid = torch.tensor(E2M1_GRID, device=codes.device)
    value = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> uint8 [..., K/2], two codes a byte (the first in the low nibble)."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K]."""
    return torch.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1)


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., K] -> fp32 [..., K / block]: each block's largest magnitude (K a multiple of block)."""
    from qarl_cli.quant.numerics import group_view

    return group_view(x.float(), block).abs().amax(-1)


def check_blocks(k: int, block: int, scheme: str) -> None:
    """A linear whose input dimension the block does not divide cannot be held in the format: one line."""
    if k % block:
        from qarl_cli.config.errors import ConfigError

        raise ConfigError(f"quant={scheme}: a linear's input dimension ({k}) of this model is not a multiple of "
                          f"the format's block of {block}; add the layer to quant.ignore")


def share_scales(model: torch.nn.Module, group_of) -> None:
    """Tell each aligned linear of `model` the others it shares a global scale with (`group_of(module name)`:
    the same name for one group), so that its Wq uses the group's amax and is rebuilt when any of them changes."""
    from qarl_cli.quant.base import CachedWq  # the aligned linears, without importing the forward stage

    if group_of is None:  # a scheme without shared scales
        return
    groups: dict[str, list] = {}
    for name, m in model.named_modules():
        if isinstance(m, CachedWq):
            groups.setdefault(group_of(name), []).append(m)
    for members in groups.values():
        for m in members:
            m.fused = tuple(members) if len(members) > 1 else ()


def group_amax(w: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """The amax of a fused group: `module`'s from `w` (under FSDP, the master gathered for this forward or
    backward), the others' from their weights."""
    others = [m.weight.detach().float().abs().amax() for m in module.fused if m is not module]
    return torch.stack([w.float().abs().amax(), *others]).amax()


# nvfp4's global scale, here rather than in nvfp4.py: its Triton quantizer (quant.triton_kernels) needs it too
FP4_TIMES_E4M3 = E4M3_MAX * E2M1_MAX  # 2688: the largest value a block can hold at global scale 1


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 g = 2688 / amax for each matrix's amax, 1 where that is not finite."""
    g = div_rn(torch.full_like(amax.float(), FP4_TIMES_E4M3), amax.float().clamp_min(torch.finfo(torch.float32).tiny))
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0)
