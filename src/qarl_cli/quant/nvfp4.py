"""quant=nvfp4: E2M1 values in blocks of 16 along the input dimension, an e4m3 scale per block and an fp32 global
scale per tensor, weights and (quant.activations) activations; compressed-tensors' `nvfp4-pack-quantized` format.

Weights, as compressed-tensors computes them for fp32 weights (`quantization/utils/helpers.py`: `generate_gparam`,
`calculate_qparams`; `quantization/lifecycle/forward_helpers.py`: `_quantize`):
- global scale g = (448 * 6) / max(amax, fp32 tiny), an infinite or NaN g replaced by 1 (an all-zero tensor);
- block scale s = e4m3(clamp(g * (amax_block / 6), +-448)), a scale that rounds to 0 replaced by 0.125 (the
  block's values are 0 either way);
- q = E2M1_RTNE(clamp(w / (s / g), +-6)).
The checkpoint holds g itself (`weight_global_scale`); vLLM stores 1 / g and dequantizes as q * (s * (1 / g))
(`utils/nvfp4_emulation_utils.py`: `dequantize_to_dtype`), which `dequantize` follows.

Activations, per token per block of 16, as vLLM's kernels define it (`ref_nvfp4_quant` in the same file, which
the CUDA `scaled_fp4_quant` implements): the global scale g_in is static, the checkpoint's `input_global_scale`
= 448 * 6 / quant.input_amax; s = e4m3(clamp(g_in * (amax_block * (1/6)), +-448)), q = E2M1_RTNE(clamp(x * (1 /
(s * (1 / g_in))), +-6)) (a zero s gives a zero multiplier), dequantized as q * (s / g_in)."""

from __future__ import annotations

from typing import Optional

import torch

from qarl_cli.config.quant import NvFp4Config
from qarl_cli.quant import ct_format
from qarl_cli.quant.base import Packed, SchemeBase
from qarl_cli.quant.fp4 import (E2M1_MAX, block_amax, check_blocks, decode_e2m1, global_scale, pack_e2m1,
                                 round_e2m1, unpack_e2m1)
from qarl_cli.quant.numerics import E4M3_MAX, div_rn, round_e4m3, use_triton

BLOCK = 16
# vLLM serves these checkpoint matrices as one layer (qkv_proj, gate_up_proj, an expert's w13) and scales all of
# them by the largest of their global scales (compressed_tensors_w4a4_nvfp4.py, process_weights_after_loading),
# so they must share one: g from the amax of them all, as llm-compressor writes them.
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
ZERO_SCALE = 0.125  # compressed-tensors' stand-in for an e4m3 scale of 0 (`_get_dtype_eps`)


def quantize_weight_ref(w: torch.Tensor, amax: Optional[torch.Tensor] = None) -> Packed:
    """w [..., N, K] -> codes packed [..., N, K/2], e4m3 scales [..., N, K/16], fp32 global scales [..., 1].
    amax: the tensor amax the global scale is computed from ([...]; default w's own, per matrix)."""
    w32 = w.float()
    amax = w32.abs().amax((-2, -1)) if amax is None else amax.float()
    g = global_scale(amax)[..., None, None]  # [..., 1, 1]
    s = round_e4m3(g * div_rn(block_amax(w32, BLOCK), E2M1_MAX))
    s32 = torch.where(s.float() == 0, ZERO_SCALE, s.float())
    step = div_rn(s32, g).repeat_interleave(BLOCK, -1)
    codes = round_e2m1(div_rn(w32, step).clamp(-E2M1_MAX, E2M1_MAX))
    return {"weight_packed": pack_e2m1(codes), "weight_scale": s32.to(torch.float8_e4m3fn),
            "weight_global_scale": g.reshape(*g.shape[:-2], 1)}


def fused_group(prefix: str) -> str:
    """The name of the group of matrices that share a global scale with `prefix` (itself when none do)."""
    parent, _, leaf = prefix.rpartition(".")
    names = next((f for f in FUSED if leaf in f), None)
    return f"{parent}.{'+'.join(names)}" if names else prefix


def dequantize_ref(packed: Packed, dtype: torch.dtype) -> torch.Tensor:
    values = decode_e2m1(unpack_e2m1(packed["weight_packed"]))
    inv_g = div_rn(torch.ones_like(packed["weight_global_scale"]), packed["weight_global_scale"].float())
    step = (packed["weight_scale"].float() * inv_g[..., None]).repeat_interleave(BLOCK, -1)
    return (values * step).to(dtype)


def quantize_act_ref(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> uint8 codes [..., K] and fp32 block scales [..., K/16] (e4m3 values), g: fp32 [] or [1]."""
    x32 = x.float()
    g = g.float().reshape(())
    sixth = torch.tensor(1 / E2M1_MAX, dtype=torch.float32)  # vLLM multiplies by the fp32 reciprocal of 6
    s = round_e4m3(g * (block_amax(x32, BLOCK) * sixth)).float()
    inv_g = div_rn(torch.ones_like(g), g)
    mult = torch.where(s == 0, 0.0, div_rn(torch.ones_like(s), s * inv_g)).repeat_interleave(BLOCK, -1)
    return round_e2m1((x32 * mult).clamp(-E2M1_MAX, E2M1_MAX)), s


def dequantize_act_ref(codes: torch.Tensor, s: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    step = div_rn(s, g.float().reshape(())).repeat_interleave(BLOCK, -1)
    return (decode_e2m1(codes) * step).to(dtype)


class NvFp4Scheme(SchemeBase):
    name = "nvfp4"
    emulated = "E2M1 values dequantized"  # no fp4 GEMM in this process: the torch engine says so at start

    def __init__(self, cfg: NvFp4Config, device: str = "auto") -> None:
        super().__init__(cfg, device)
        self.quantizes_activations = cfg.activations
        self.input_global_scale = global_scale(torch.tensor(cfg.input_amax, dtype=torch.float32))

    fused_group = staticmethod(fused_group)  # callers that hold several matrices give quantize their group's amax

    def quantize(self, w: torch.Tensor, amax: Optional[torch.Tensor] = None) -> Packed:
        """amax: the global amax of w's fused group (default: w's own)."""
        check_blocks(w.shape[-1], BLOCK, self.name)
        if use_triton(w):
            from qarl_cli.quant.triton_kernels import weight_quant_nvfp4

            return weight_quant_nvfp4(w, amax)
        return quantize_weight_ref(w, amax)

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_ref(packed, dtype)

    def quantize_act(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.input_global_scale.to(x.device)
        if use_triton(x):
            from qarl_cli.quant.triton_kernels import act_quant_nvfp4

            return act_quant_nvfp4(x, g)
        return quantize_act_ref(x, g)

    def dequantize_act(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_act_ref(q, scale, self.input_global_scale.to(q.device), dtype)

    def packed_tensors(self, prefix: str, packed: Packed, shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
        out = super().packed_tensors(prefix, packed, shape)
        if self.quantizes_activations:  # W4A4: the static activation global scale, one per layer as vLLM loads it
            out.append((f"{prefix}.input_global_scale", self.input_global_scale.reshape(1).clone()))
        return out

    def quantization_config(self, ignore: list[str]) -> dict:
        weights = ct_format.fp4_args(BLOCK, "tensor_group", dynamic=False, scale_dtype="torch.float8_e4m3fn")
        acts = ct_format.fp4_args(BLOCK, "tensor_group", dynamic="local", scale_dtype="torch.float8_e4m3fn") \
            if self.quantizes_activations else None
        return ct_format.config_block("nvfp4-pack-quantized", weights, acts, ignore)
