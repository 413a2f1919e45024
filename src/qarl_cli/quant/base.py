"""The quantization stage's contract (`quant` group): a scheme quantizes weights into the packed tensors a vLLM
checkpoint holds, dequantizes them, quantizes activations the way the rollout kernels do, and describes its
checkpoint format. Each scheme module also holds the pure-torch reference that is the ground truth."""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from qarl_cli.config.quant import QuantConfig

Packed = dict  # checkpoint suffix ("weight", "weight_scale", ...) -> tensor, exactly as vLLM loads it


class Scheme(Protocol):
    """Schemes with a low-bit GEMM for the aligned forward's kernel=lowbit (int8, w4a16) also have
    `lowbit_matmul(x, packed, w_dq) -> y`."""

    name: str
    cfg: QuantConfig
    quantizes_weights: bool  # False: the identity scheme; the aligned forward and the writer select nothing
    quantizes_activations: bool  # False: activations stay in the compute dtype (w4a16, none)

    def quantize(self, w: torch.Tensor) -> Packed:
        """w [..., N, K] (each leading index one matrix, quantized on its own) -> packed tensors + scales."""
        ...

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        """The weight the rollout kernels compute with, [..., N, K] in `dtype`."""
        ...

    def fake_quant_weight(self, w: torch.Tensor) -> torch.Tensor:
        """dequantize(quantize(w)) in w's dtype."""
        ...

    def fake_quant_act(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] quantized and dequantized as the engine does before its GEMM (x itself if not quantized)."""
        ...

    def checkpoint_tensors(self, prefix: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs of one 2-D linear weight `prefix.weight` in the scheme's vLLM checkpoint."""
        ...

    def packed_tensors(self, prefix: str, packed: Packed, shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
        """The same pairs from an already quantized weight of `shape` (no quantization)."""
        ...

    def quantization_config(self, ignore: list[str]) -> Optional[dict]:
        """config.json's `quantization_config` block; `ignore`: linear layers left unquantized. None: no block."""
        ...


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


class SchemeBase:
    """What every scheme derives from its quantize / dequantize / quantize_act."""

    name = "base"
    quantizes_weights = True  # False: the identity scheme (none); nothing is selected
    quantizes_activations = True
    # What rollout=torch computes in place of the engine's low-bit kernel (said in one line at its start); None:
    # nothing to say (no quantization, or int8 / fp8 whose GEMMs the aligned modules compute as the engine does)
    emulated: Optional[str] = None

    def __init__(self, cfg: QuantConfig, device: str = "auto") -> None:
        self.cfg = cfg
        self.device = resolve_device(device)  # where the rollout engine runs; the int8 weight range depends on it

    def quantize(self, w: torch.Tensor) -> Packed:
        raise NotImplementedError

    def dequantize(self, packed: Packed, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def quantize_act(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def dequantize_act(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def fake_quant_weight(self, w: torch.Tensor) -> torch.Tensor:
        return self.dequantize(self.quantize(w), w.dtype)

    def fake_quant_act(self, x: torch.Tensor) -> torch.Tensor:
        if not self.quantizes_activations:
            return x
        return self.dequantize_act(*self.quantize_act(x), x.dtype)

    def checkpoint_tensors(self, prefix: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.packed_tensors(prefix, self.quantize(w), tuple(w.shape))

    def packed_tensors(self, prefix: str, packed: Packed, shape: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
        return [(f"{prefix}.{suffix}", t.contiguous()) for suffix, t in packed.items()]

    def quantization_config(self, ignore: list[str]) -> Optional[dict]:
        raise NotImplementedError


@runtime_checkable
class CachedWq(Protocol):
    """A module that holds a scheme's Wq for this step (the aligned forward's linears, qarl_cli.forward.aligned):
    the checkpoint writer and the weight sync read its packed tensors instead of quantizing the weight again."""

    scheme: Scheme

    def packed(self) -> Packed:
        ...
