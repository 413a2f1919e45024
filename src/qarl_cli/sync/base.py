"""The sync stage's contract (`sync` group)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import nn

    from qarl_cli.rollout.base import RolloutEngine


class Sync(Protocol):
    """Built as impl(cfg, scheme, plan, probe, gather=...)."""

    def push(self, model: "nn.Module", engine: "RolloutEngine") -> dict[str, float]:
        """Put `model`'s current weights into `engine`; metrics (time/sync, sync/*). All or nothing: a push that
        fails leaves the engine on its previous weights and raises WeightSyncError."""
        ...

    def close(self) -> None:
        """Release what the transport holds (the servers' bucket files, the transfer groups)."""
        ...

    def calibrate(self, model: "nn.Module", engine: "RolloutEngine") -> str:
        """Before training, while engine and trainer hold the same weights: what the engine serves now (the
        baseline of sync/lowbit_changed_*), and what the kernels alone make of the verify's gap, so the verify's
        bound; a line to show when it says more than sync.verify_tolerance."""
        ...
