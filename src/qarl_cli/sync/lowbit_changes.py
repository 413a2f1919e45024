"""How much of the low-bit model the engine serves changed at a sync: `sync/lowbit_changed_frac` (the fraction of
quantized weight elements whose low-bit value, q times its scale, differs from the previous sync's) and
`sync/lowbit_changed_tensors` (how many quantized matrices changed at all).

An RL update is small (AdamW at lr 1e-6 moves a weight by about 1e-6) and a quantization step is not (int8: amax /
127; int4: amax / 7), so most of an update can vanish in the rounding and the engine keep sampling from the same
low-bit policy: then quantized rollouts are not following training. This measures it at every sync.

The tracker watches the stream the sync sends: in mode=prequantized the packed tensors themselves, in mode=online
the masters, quantized here with the same scheme (what the engine will compute). It keeps the previous sync's
packed tensors on the host (a byte per weight for int8 and fp8, half a byte for int4, plus scales). Before
training the sync primes it with the weights the engine starts with (`prime`), so the first sync after a start or
a resume is compared too, and a resumed run logs what an unbroken one does. A push that fails changes nothing."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional

import torch


class LowbitChanges:
    def __init__(self, scheme: Any, plan: Any, mode: str) -> None:
        self.scheme, self.quantized, self.mode = scheme, plan.quantized, mode
        self.previous: dict[str, dict[str, torch.Tensor]] = {}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.changed = self.total = self.tensors = 0
        self.group_of = getattr(scheme, "fused_group", None)  # nvfp4: matrices sharing a global scale
        self.members: dict[str, set] = {}
        for name in self.quantized if self.group_of else ():
            self.members.setdefault(self.group_of(name.removesuffix(".weight")), set()).add(name)

    def watch(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights`, passed through unchanged, each quantized matrix's low-bit value compared on the way."""
        self.pending, self.changed, self.total, self.tensors = {}, 0, 0, 0
        prefix: Optional[str] = None
        parts: dict[str, torch.Tensor] = {}
        held: dict[str, dict[str, torch.Tensor]] = {}  # online: a fused group's masters until all of them came
        for name, tensor in weights:
            if self.mode == "online":
                if name in self.quantized:
                    self._quantize_online(name, tensor.detach(), held)
            else:  # a packed matrix arrives as consecutive parts under its prefix (weight, weight_scale, ...)
                head, _, suffix = name.rpartition(".")
                if head != prefix and parts:
                    self._record(prefix, parts)
                    parts = {}
                if f"{head}.weight" in self.quantized:
                    prefix, parts[suffix] = head, tensor
                else:
                    prefix = None
            yield name, tensor
        if parts:
            self._record(prefix, parts)

    def _quantize_online(self, name: str, master: torch.Tensor, held: dict) -> None:
        """Record a master quantized as the engine will: alone, or for a scheme whose fused matrices share a
        scale (nvfp4's `fused_group`) with its group's amax, once the whole group came."""
        if self.group_of is None:
            self._record(name.removesuffix(".weight"), self.scheme.quantize(master))
            return
        group = self.group_of(name.removesuffix(".weight"))
        held.setdefault(group, {})[name] = master
        if held[group].keys() == self.members[group]:
            tensors = held.pop(group)
            amax = torch.stack([t.float().abs().amax() for t in tensors.values()]).amax()
            for n, t in tensors.items():
                self._record(n.removesuffix(".weight"), self.scheme.quantize(t, amax=amax))

    def _record(self, prefix: str, packed: dict[str, torch.Tensor]) -> None:
        packed = {k: v.detach().to("cpu", copy=True) for k, v in packed.items()}
        before = self.previous.get(prefix)
        if before is not None:
            now = self.scheme.dequantize(packed, torch.float32)
            diff = int((now != self.scheme.dequantize(before, torch.float32)).sum())
            self.changed += diff
            self.total += now.numel()
            self.tensors += diff > 0
        self.pending[prefix] = packed

    def prime(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take `weights` (the stream a sync would send now) as what the engine serves."""
        for _ in self.watch(weights):
            pass
        self.commit()

    def commit(self) -> dict[str, float]:
        """After a push the engine took: this sync's figures (none when nothing was primed or sent before), and its
        weights become the previous ones."""
        compared = self.total > 0
        self.previous.update(self.pending)
        self.pending = {}
        if not compared:
            return {}
        return {"sync/lowbit_changed_frac": self.changed / self.total, "sync/lowbit_changed_tensors": self.tensors}
