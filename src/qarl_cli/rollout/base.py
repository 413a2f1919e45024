"""The rollout stage's contract (`rollout` group). An engine samples n responses per prompt with the
per-token logprob of each sampled token (`rollout_logprobs`: raw model logprobs, before temperature and top-p,
which is what the objectives compare with the trainer's), scores given sequences (the sync's verify probe), and
takes new weights in place.

Engines do not know how weights travel: the sync stage (qarl_cli.sync) brings them, through vLLM's RL API to a
vLLM engine or as tensors to the torch engine's load_weights. They arrive as (name, tensor) in checkpoint format,
in the format of sync.mode (one of config.stages.SYNC_MODES): `prequantized`, the scheme's packed low-bit tensors
and scales (`quant.checkpoint.quantized_state`), which the engine uses as they are; `online`, the trainer's
unquantized masters, which the engine quantizes with the same scheme. A load either applies completely or raises
WeightSyncError and leaves the engine on its old weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol, Sequence

import torch

from qarl_cli.config.errors import UserError

FINISH_REASONS = ("stop", "length")  # stop: the model ended its turn (EOS); length: max_tokens reached


def stop_ids(eos_token_id) -> frozenset[int]:
    """The token ids that end a response, from an `eos_token_id` as tokenizers and generation configs hold it
    (one id, a list of them, or None)."""
    if eos_token_id is None:
        return frozenset()
    return frozenset(eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])


class WeightSyncError(UserError, RuntimeError):
    """Weights the engine refuses (unknown name, wrong shape or dtype, NaN/inf, a failed verify probe). The
    engine keeps serving its previous weights."""


@dataclass
class RolloutBatch:
    """Samples in prompt-major order: the n samples of prompt 0, then those of prompt 1, ..."""

    prompt_index: list[int]  # which prompt each sample answers
    response_ids: list[list[int]]  # sampled tokens, the stop token included when the model stopped
    rollout_logprobs: list[list[float]]  # one per response token
    finish_reasons: list[str]  # one of FINISH_REASONS
    seconds: float = 0.0  # wall time of the generate call
    meta: dict = field(default_factory=dict)
    # Routing replay (qarl_cli.forward.routing): per sample, the experts each MoE layer routed every token the engine
    # ran to, int16 [prompt + response - 1, layers, top_k] from position 0; None when the engine returns none.
    routed_experts: Optional[list[torch.Tensor]] = None

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


class RolloutEngine(Protocol):
    name: str

    def generate(self, prompts: Sequence[Sequence[int]], n: int, temperature: float, top_p: float,
                 max_tokens: int, seed: int) -> RolloutBatch:
        """n samples per prompt (token ids, chat template already applied). temperature 0 is greedy.
        The same seed, prompts and weights give the same samples."""
        ...

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token_t | tokens_<t) for t = 1 .. len-1 of each sequence (the verify probe)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], mode: str = "prequantized") -> None:
        """Replace the weights named (a subset of the checkpoint's names is fine), all or nothing; `mode`: the
        format they come in (sync.mode). vLLM engines take weights through `weight_receivers()` instead."""
        ...

    def sleep(self) -> None:
        """Free the engine's accelerator memory while the trainer updates (rollout.sleep_between_steps on a GPU);
        a no-op where it cannot (CPU, the embedded engine)."""
        ...

    def wake_up(self) -> None:
        """Take the memory back, weights as they were, before the next sync and rollout; a no-op where sleep is."""
        ...

    def close(self) -> None:
        ...


def build_engine(cfg, model_dir: Path, scheme, *, dtype: str = "bfloat16",
                 seed: int = 0, max_model_len: Optional[int] = None, device: str = "auto",
                 workdir: Optional[Path] = None, log_dir: Optional[Path] = None) -> RolloutEngine:
    """The engine of `rollout=cfg.name` serving the unquantized checkpoint `model_dir` quantized with `scheme`.
    max_model_len: the longest prompt + response the run needs. workdir: where an engine may write the
    quantized checkpoint it starts from (a temporary directory when None). log_dir: where the servers' logs go
    (the run directory: they outlive the run; None: beside the checkpoint, removed with it)."""
    from qarl_cli.stages import resolve

    return resolve("rollout", cfg.name)(cfg, Path(model_dir), scheme, dtype=dtype, seed=seed,
                                        max_model_len=max_model_len, device=device, workdir=workdir,
                                        log_dir=log_dir)


def context_length(cfg: Any, model_dir: Path) -> int:
    """The engine's context in tokens (prompt + response): rollout.max_model_len where the option has one and
    it is set, else what the model supports (max_position_embeddings of its config.json). Prompts are checked
    against it before they reach an engine (data.prompts.check_lengths)."""
    import json

    configured = getattr(cfg, "max_model_len", None)
    if configured:
        return int(configured)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    return int(config["max_position_embeddings"])
