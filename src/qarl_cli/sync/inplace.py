"""sync=inplace: the trainer's new weights go into the running engine, in place.

mode=prequantized (the paper's path): Wq' = Q(W') is computed once, by the trainer, with the scheme the aligned
forward uses, and the packed low-bit tensors + scales are sent; the engine does not quantize. mode=online: the
unquantized masters are sent and the engine quantizes them with the same scheme (half the bytes of bf16 are
saved by prequantized on a real interconnect). For vLLM engines the weights travel as checked buckets through vLLM's
RL API (sync.transfer; `bucket_mb`), to an in-process engine or to every server of rollout=vllm_server.

Every `verify_every` syncs a probe runs: the engine scores fixed sequences and its logprobs are compared with the
aligned trainer's on the same tokens. Before it, on vLLM engines (`checksums`), every server's `/weight_checker`
digests are compared with the sent tensors' wherever the engine keeps a tensor as sent (sync.checksums); a
mismatch puts the servers back on the previous version and names the tensor. Kernels differ by rounding (vLLM's attention and norms, int8 activation
rounding flips), so the check is on the mean |gap| over the probe's tokens; a stale, garbled or NaN engine is
far above any sane tolerance. How far the kernels alone put the engine depends on the model, the scheme and the
engine's dtype (a fp32 tiny model: 1e-6 to 3e-3; SmolLM2 in fp16 W4A16: 9e-3; in int8 W8A8, whose activation
rounding flips cascade through 30 layers: 0.2), so before training `calibrate` measures it on weights the engine
and the trainer share, and the verify accepts up to VERIFY_FLOOR_FACTOR times that where it is above
sync.verify_tolerance (said in one line, with what the probe can then still catch)."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterator, Optional, Sequence

from torch import nn

from qarl_cli.config.stages import InplaceSyncConfig
from qarl_cli.forward.logprobs import sequence_logprobs
from qarl_cli.rollout.base import RolloutEngine, WeightSyncError

# The verify's bound on an engine whose kernels alone put it this far from the trainer: a few times that floor
# (the gap moves with the weights, by a fraction of itself), far below a garbled or NaN engine.
VERIFY_FLOOR_FACTOR = 3.0


class InplaceSync:
    def __init__(self, cfg: InplaceSyncConfig, scheme: Any, plan: Any, probe: Sequence[Sequence[int]] = (),
                 gather: Optional[Callable[[nn.Module], Iterator]] = None) -> None:
        """plan: the checkpoint plan of the served model (`quant.checkpoint.plan_for`); probe: token sequences
        for the verify check (needed when cfg.verify_every > 0); gather: for a sharded model, a collective that
        yields its full checkpoint-named tensors on the rank that owns the engine (nothing on the others), gathered
        as they are read."""
        if cfg.verify_every and not probe:
            raise ValueError("sync.verify_every > 0 needs probe sequences")
        self.cfg, self.scheme, self.plan, self.probe = cfg, scheme, plan, [list(p) for p in probe]
        self.gather = gather
        self.syncs = 0
        self.tolerance = cfg.verify_tolerance  # raised by calibrate() to a few times the kernels' own floor
        self.changes = None
        if cfg.track_lowbit and scheme.quantizes_weights:
            from qarl_cli.sync.lowbit_changes import LowbitChanges

            self.changes = LowbitChanges(scheme, plan, cfg.mode)

    def weights(self, model: nn.Module):
        """What goes over the wire for this mode: (name, tensor) in checkpoint format."""
        from qarl_cli.quant.checkpoint import quantized_state
        from qarl_cli.quant.select import checkpoint_state

        # sharded: (name, tensor) pairs gathered as they are read, a collective every rank takes part in
        state = self.gather(model) if self.gather else model
        if self.cfg.mode == "prequantized":
            return quantized_state(state, self.scheme, self.plan)
        return iter(checkpoint_state(state).items()) if isinstance(state, nn.Module) else iter(state)

    def push(self, model: nn.Module, engine: RolloutEngine) -> dict[str, float]:
        """Send `model`'s weights to `engine`; metrics `time/sync` (and the probe's gaps when it ran). A failed
        verify raises WeightSyncError after the load. vLLM engines, in this process or servers (an engine with
        weight_receivers), get them through vLLM's RL API (sync.transfer); the torch engine takes the tensors
        (load_weights)."""
        start = time.perf_counter()
        weights = self.weights(model)  # under torchrun the other ranks gather in here, in step with rank 0's reads
        if self.changes is not None:
            weights = self.changes.watch(weights)
        version = str(self.syncs + 1)
        due = bool(self.cfg.verify_every) and (self.syncs + 1) % self.cfg.verify_every == 0

        def deliver(target: Any) -> dict[str, float]:
            try:
                if hasattr(target, "weight_receivers"):
                    return self._transfer(target).push(weights, version, check=due and self.cfg.checksums)
                target.load_weights(weights, self.cfg.mode)
                return {}
            finally:
                if self.gather:  # a refused push stopped reading: the other ranks still wait in its gathers
                    for _ in weights:
                        pass

        # rank 0's engine as all ranks see it (train.distributed.MainEngine) delivers there, errors everywhere
        metrics = dict((engine.deliver(deliver) if hasattr(engine, "deliver") else deliver(engine)) or {})
        metrics["time/sync"] = time.perf_counter() - start
        if self.changes is not None:
            metrics.update(self.changes.commit())
        self.syncs += 1
        if due:
            metrics.update(self.verify(model, engine))
        return metrics

    def _transfer(self, engine: Any):
        if getattr(self, "transfer", None) is None or self.transfer.engine is not engine:
            from dataclasses import asdict

            from qarl_cli.sync.transfer import RLApiTransfer

            online = ({"quant": asdict(self.scheme.cfg), "source": str(engine.source)}
                      if self.cfg.mode == "online" else None)
            self.transfer = RLApiTransfer(engine, engine.scratch / "sync", self.cfg.bucket_mb << 20, online,
                                          checksums=bool(self.cfg.verify_every) and self.cfg.checksums)
        return self.transfer

    def close(self) -> None:
        if getattr(self, "transfer", None) is not None:
            self.transfer.close()

    def calibrate(self, model: nn.Module, engine: RolloutEngine) -> str:
        if self.changes is not None:  # under torchrun every rank takes part in the gather, as in push
            self.changes.prime(self.weights(model))
        if not self.cfg.verify_every:
            return ""
        floor, worst, _ = self._gaps(model, engine)
        if not math.isfinite(floor):
            raise WeightSyncError(f"sync verify: before training the engine's logprobs are not finite on the "
                                  f"weights it was started with (mean |gap| {floor}); it does not serve the model")
        if VERIFY_FLOOR_FACTOR * floor <= self.cfg.verify_tolerance:
            return ""
        self.tolerance = VERIFY_FLOOR_FACTOR * floor
        return (f"sync verify: on the weights it started with, this engine's logprobs differ from the trainer's by "
                f"{floor:.3g} on average (max {worst:.3g}): kernel rounding alone, above sync.verify_tolerance="
                f"{self.cfg.verify_tolerance}; each verify accepts up to {self.tolerance:.3g} ({VERIFY_FLOOR_FACTOR:g}x"
                " that), which catches a garbled or NaN engine but not necessarily a stale one"
                + (" (the checksums still check every tensor sent)" if self.cfg.checksums else ""))

    def verify(self, model: nn.Module, engine: RolloutEngine) -> dict[str, float]:
        mean, worst, count = self._gaps(model, engine)
        if not math.isfinite(mean) or mean > self.tolerance:
            raise WeightSyncError(
                f"sync verify: the engine's logprobs differ from the trainer's by {mean:.3g} on average (max "
                f"{worst:.3g}) over {count} probe tokens, above {self._bound()}; the engine is not serving the "
                "trainer's weights")
        return {"sync/verify_gap_mean": mean, "sync/verify_gap_max": worst}

    def _bound(self) -> str:
        if self.tolerance == self.cfg.verify_tolerance:
            return f"sync.verify_tolerance={self.cfg.verify_tolerance}"
        return f"{self.tolerance:.3g} ({VERIFY_FLOOR_FACTOR:g}x the kernels' own gap, measured before training)"

    def _gaps(self, model: nn.Module, engine: RolloutEngine) -> tuple[float, float, int]:
        """Mean and max |logprob gap| between every engine (each server) and the trainer on the probe, and over
        how many tokens."""
        was_training = model.training
        model.eval()
        try:
            trainer = sequence_logprobs(model, self.probe)
        finally:
            model.train(was_training)
        if hasattr(engine, "weight_receivers"):  # every server must serve the new weights, not just one
            served_each = [engine.score(self.probe, server=s.index) for s in engine.weight_receivers()]
        else:
            served_each = [engine.score(self.probe)]
        gaps = [abs(a - b) for served in served_each for s, t in zip(served, trainer) for a, b in zip(s, t)]
        return (sum(gaps) / len(gaps) if gaps else 0.0), max(gaps, default=0.0), len(gaps)
