"""quant=fp8_block, W8A8 float8 e4m3: weights in 128x128 blocks (scale = amax / 448), activations per token per
group of 128 channels, dynamic; vLLM's `fp8` format with `weight_block_size` (the Qwen3-*-FP8 / DeepSeek-V3
layout: `weight` e4m3 [N, K] + `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)], the dequantization scale).

The activation reference follows vLLM's CUDA `per_token_group_fp8_quant` (the engine that runs this scheme):
amax floored at 1e-10, scale = amax / 448, q = e4m3_RTNE(clamp(x / scale, -448, 448)), divisions IEEE. Partial
weight blocks (N or K not a multiple of 128) take the amax of the elements they hold."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qarl_cli.config.quant import Fp8BlockConfig
from qarl_cli.quant.base import Packed, SchemeBase
from qarl_cli.quant.numerics import (E4M3_MAX, FP8_ACT_AMAX_EPS, absmax_scale, div_rn, group_view, round_e4m3,
                                     use_triton)


def quantize_weight_ref(w: torch.Tensor, block: tuple[int, int]) -> Packed:
    bn, bk = block
    *lead, n, k = w.shape
    padded = F.pad(w.float(), (0, -k % bk, 0, -n % bn))  # zero padding leaves every block's amax unchanged
    nb, kb = padded.shape[-2] // bn, padded.shape[-1] // bk
    blocks = padded.reshape(*lead, nb, bn, kb, bk)
    scale = absmax_scale(blocks.abs().amax(dim=(-3, -1)), E4M3_MAX)
    q = round_e4m3(div_rn(blocks, scale[..., :, None, :, None])).reshape(padded.shape)
    return {"weight": q[..., :n, :k].contiguous(), "weight_scale_inv": scale}


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """[..., ceil(N/bn), ceil(K/bk)] -> [..., N, K]: every element's block scale."""
    return scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :n, :k]


def quantize_act_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = group_view(x.float(), group)
    scale = div_rn(g.abs().amax(-1, keepdim=True).clamp_min(FP8_ACT_AMAX_EPS), E4M3_MAX)
    return round_e4m3(div_rn(g, scale)).reshape(x.shape), scale.squeeze(-1)


class Fp8BlockScheme(SchemeBase):
    name = "fp8_block"
    quantizes_activations = True

    def __init__(self, cfg: Fp8BlockConfig, device: str = "auto") -> None:
        super().__init__(cfg, device)
        self.block = (cfg.block_size[0], cfg.block_size[1])

    def quantize(self, w: torch.Tensor) -> Packed:
        if use_triton(w):
            from qarl_cli.quant.triton_kernels import weight_quant_fp8_block

            return weight_quant_fp8_block(w, self.block)
        return quantize_weight_ref(w, self.block)

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        q = packed["weight"]
        scale = expand_block_scale(packed["weight_scale_inv"], self.block, q.shape[-2], q.shape[-1])
        return (q.float() * scale).to(dtype)

    def quantize_act(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x):
            from qarl_cli.quant.triton_kernels import act_quant_fp8_group

            return act_quant_fp8_group(x, self.block[1])
        return quantize_act_ref(x, self.block[1])

    def dequantize_act(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (group_view(q.float(), self.block[1]) * scale[..., None]).reshape(q.shape).to(dtype)

    def quantization_config(self, ignore: list[str]) -> dict:
        # vLLM's Fp8Config and transformers' FineGrainedFP8Config both read modules_to_not_convert (exact names).
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": sorted(ignore)}
