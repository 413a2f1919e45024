"""quant=mxfp4 (OCP MX): E2M1 values in blocks of 32 along the input dimension, each block scaled by a power of two
stored as its E8M0 exponent (uint8, bias 127); weights and (quant.activations) activations, dynamic. The
checkpoint is compressed-tensors' `mxfp4-pack-quantized`: `weight_packed` uint8 [N, K/2] (codes as in fp4.py),
`weight_scale` uint8 [N, K/32], which vLLM's CompressedTensorsW4A4Mxfp4 loads (W4A4 on Blackwell with FlashInfer,
weight-only through Marlin elsewhere).

The scale exponent is the same for weights and activations, and the same in both definitions this follows:
compressed-tensors' `generate_mx_scales` (quantization/utils/mxfp_utils.py) for the checkpoint and vLLM's Triton
`_compute_quant_and_scale` (model_executor/layers/quantization/utils/mxfp4_utils.py) for activations. The block
amax is first rounded on its fp32 bit pattern to one mantissa bit (add 2**21 to the bits, keep sign and
exponent: an amax of 1.75 * 2**e or more becomes 2**(e+1)), then e = floor(log2(that)) - 2 (2 = floor(log2(6))),
the E8M0 byte e + 127 clamped to [0, 254] (254: the largest finite E8M0; an all-zero block gets 0, scale 2**-127).
Then q = E2M1_RTNE(clamp(x / 2**e, +-6)); the division by a power of two is exact, so compressed-tensors'
x / scale and vLLM's x * (1 / scale) agree. Dequantized: q * 2**e in fp32, exact, then the compute dtype."""

from __future__ import annotations

import torch

from qarl_cli.config.quant import MxFp4Config
from qarl_cli.quant import ct_format
from qarl_cli.quant.base import Packed, SchemeBase
from qarl_cli.quant.fp4 import E2M1_MAX, block_amax, check_blocks, decode_e2m1, pack_e2m1, round_e2m1, unpack_e2m1
from qarl_cli.quant.numerics import div_rn, use_triton

BLOCK = 32
E8M0_BIAS = 127
E8M0_MAX = 254  # 255 is E8M0's NaN
ELEM_EMAX = 2  # floor(log2(6)), E2M1's largest exponent


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """fp32 block amax (>= 0) -> the uint8 E8M0 byte of its scale."""
    bits = amax.float().contiguous().view(torch.int32)
    field = ((bits + 0x200000) & 0x7F800000) >> 23  # biased exponent of the amax rounded to one mantissa bit
    return (field - ELEM_EMAX).clamp(0, E8M0_MAX).to(torch.uint8)


def exponent_scale(e8m0: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes -> fp32 2**(byte - 127) (byte 0: the subnormal 2**-127)."""
    e = e8m0.to(torch.int32)
    return torch.where(e > 0, e << 23, torch.full_like(e, 0x400000)).view(torch.float32)


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> uint8 codes [..., K] and uint8 E8M0 scales [..., K/32] (weights and activations alike)."""
    x32 = x.float()
    e8m0 = scale_exponent(block_amax(x32, BLOCK))
    step = exponent_scale(e8m0).repeat_interleave(BLOCK, -1)
    return round_e2m1(div_rn(x32, step).clamp(-E2M1_MAX, E2M1_MAX)), e8m0


def dequantize_ref(codes: torch.Tensor, e8m0: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (decode_e2m1(codes) * exponent_scale(e8m0).repeat_interleave(BLOCK, -1)).to(dtype)


class MxFp4Scheme(SchemeBase):
    name = "mxfp4"
    emulated = "E2M1 values dequantized"  # no fp4 GEMM in this process: the torch engine says so at start

    def __init__(self, cfg: MxFp4Config, device: str = "auto") -> None:
        super().__init__(cfg, device)
        self.quantizes_activations = cfg.activations

    def quantize(self, w: torch.Tensor) -> Packed:
        check_blocks(w.shape[-1], BLOCK, self.name)
        codes, e8m0 = self.quantize_act(w)  # the same quantizer for weights and activations
        return {"weight_packed": pack_e2m1(codes), "weight_scale": e8m0}

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_ref(unpack_e2m1(packed["weight_packed"]), packed["weight_scale"], dtype)

    def quantize_act(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x):
            from qarl_cli.quant.triton_kernels import quant_mxfp4

            return quant_mxfp4(x)
        return quantize_ref(x)

    def dequantize_act(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_ref(q, scale, dtype)

    def quantization_config(self, ignore: list[str]) -> dict:
        weights = ct_format.fp4_args(BLOCK, "group", dynamic=False, scale_dtype="torch.uint8")
        acts = ct_format.fp4_args(BLOCK, "group", dynamic=True, scale_dtype="torch.uint8") \
            if self.quantizes_activations else None
        return ct_format.config_block("mxfp4-pack-quantized", weights, acts, ignore)
