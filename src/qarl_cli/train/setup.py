"""Everything a training run holds, built from the config in one place: model, tokenizer, data, learner, rollout
engine, reward, sync and logger (and, on resume, the checkpoint's weights and trainer state). Each stage is the
implementation its config option names (qarl_cli.stages.resolve)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch

from qarl_cli.config.errors import UserError
from qarl_cli.config.root import TrainConfig

if TYPE_CHECKING:
    from qarl_cli.data.base import DataSource, Problem
    from qarl_cli.reward.base import RewardFn
    from qarl_cli.rollout.base import RolloutEngine
    from qarl_cli.sync.base import Sync
    from qarl_cli.update.distributed import Single
    from qarl_cli.update.learner import Learner
    from qarl_cli.train.loggers import Logger


@dataclass
class Run:
    cfg: TrainConfig
    run_dir: Path
    source: Path  # the unquantized checkpoint the run started from
    tokenizer: Any  # a transformers tokenizer
    splits: "DataSource"
    test_prompts: list[list[int]]  # token ids of splits.test, encoded once
    context: int  # the engine's context in tokens: every prompt leaves room for max_new_tokens in it
    learner: "Learner"
    engine: "RolloutEngine"
    reward: "RewardFn"
    sync: "Sync"
    logger: "Logger"
    dist: "Single"  # train.distributed: Single, or the torchrun ranks
    start_step: int = 0
    resumed_from: Optional[Path] = None
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    # what the checkpoint recorded of the rollouts (train.rollouts.Rollouts.record); None: nothing (a fresh run, or a
    # checkpoint written on a stop)
    rollouts_saved: Optional[dict] = None

    @property
    def model(self) -> torch.nn.Module:
        return self.learner.model

    def encode(self, problems: Sequence["Problem"]) -> list[list[int]]:
        """Prompt token ids of `problems`, each checked to fit the engine's context with max_new_tokens."""
        from qarl_cli.data.prompts import check_lengths, encode

        ids = encode(self.tokenizer, self.cfg.data, problems)
        check_lengths(ids, problems, self.context, self.cfg.max_new_tokens)
        return ids

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


def build(cfg: TrainConfig, run_dir: Path, log=print, dist: Any = None) -> Run:
    """dist: train.distributed's view of the ranks (None: one process)."""
    from transformers import AutoTokenizer

    from qarl_cli.data.prompts import check_lengths, encode
    from qarl_cli.data.splits import load_splits
    from qarl_cli.models.integrity import check_model_dir, load_model
    from qarl_cli.models.resolve import model_dir
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.base import resolve_device
    from qarl_cli.quant.checkpoint import load_meta_model, plan_for
    from qarl_cli.rollout.base import context_length
    from qarl_cli.stages import resolve
    from qarl_cli.update.distributed import MainEngine, MainReward, Single
    from qarl_cli.update.learner import Learner
    from qarl_cli.train import rundir
    from qarl_cli.train.loggers import NullLogger
    from qarl_cli.train.state import check_steps_left, find_resume, load_trainer_state

    dist = dist or Single()
    torch.manual_seed(cfg.seed)
    device = torch.device(resolve_device(cfg.device))
    ckpt = find_resume(cfg.resume, run_dir)
    if ckpt:  # before any model is built or loaded: a resume that cannot go on stops here, in one line
        check_steps_left(ckpt, cfg.steps, cfg.dry_run)
        rundir.check_resume(ckpt, rundir.config_dict(cfg))
        check_model_dir(ckpt / "model", f"resume={cfg.resume}")
    source = model_dir(cfg.model, log=log)
    weights = ckpt / "model" if ckpt else source
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    splits = load_splits(cfg.data, cfg.seed)
    context = context_length(cfg.rollout, source)
    test_prompts = encode(tokenizer, cfg.data, splits.test)
    check_lengths(test_prompts, splits.test, context, cfg.max_new_tokens)
    train = getattr(splits, "train", None)  # a finite training set (a file) is checked whole, now
    if train:
        check_lengths(encode(tokenizer, cfg.data, train), train, context, cfg.max_new_tokens)
    scheme = build_scheme(cfg.quant, device.type)
    model = load_model(weights, dtype=getattr(torch, cfg.model.dtype))  # files complete, weights finite
    model = resolve("forward", cfg.forward.name)(cfg.forward, scheme).apply(model.to(device))
    learner = Learner(dist.shard(model), cfg, resolve("algorithm", cfg.algorithm.name), device, dist)
    saved = load_trainer_state(ckpt, learner) if ckpt else {}
    start = saved.get("step", 0)
    if ckpt:
        rundir.tidy_for_resume(run_dir, start, cfg.logger.metrics_file, dist.main)

    stack = contextlib.ExitStack()
    try:  # rank 0 runs the engine and the reward; under torchrun the others get what they return
        engine = dist.main_only(lambda: _start_engine(cfg, weights, scheme, context, device.type, run_dir),
                                send=False)
        if getattr(engine, "routing_note", None):  # routing replay asked for by default, off under this engine
            log(f"[qarl] {engine.routing_note}")
        if getattr(engine, "emulation_note", None):  # a scheme rollout=torch runs without its kernels
            log(f"[qarl] {engine.emulation_note}")
        engine = MainEngine(dist, engine) if dist.world > 1 else engine
        stack.callback(engine.close)
        reward = dist.main_only(lambda: resolve("reward", cfg.reward.name)(cfg.reward), send=False)
        reward = MainReward(dist, reward) if dist.world > 1 else reward
        stack.callback(reward.close)
        probe = _probe(tokenizer, test_prompts[:8], splits.test[:8])
        sync = resolve("sync", cfg.sync.name)(cfg.sync, scheme, plan_for(load_meta_model(source), scheme), probe,
                                              gather=_gatherer(dist) if dist.world > 1 else None)
        stack.callback(sync.close)
        logger = (resolve("logger", cfg.logger.name) if dist.main else NullLogger)(
            cfg.logger, run_dir, rundir.config_dict(cfg))
        stack.callback(logger.close)
    except BaseException:
        stack.close()
        raise
    return Run(cfg, run_dir, source, tokenizer, splits, test_prompts, context, learner, engine, reward, sync,
               logger, dist, start, ckpt, stack, saved.get("rollouts"))


def _start_engine(cfg: TrainConfig, weights: Path, scheme: Any, context: int, device: str,
                  run_dir: Path) -> "RolloutEngine":
    """The rollout engine serving `weights`. vLLM rejects what it cannot serve with a ValueError (its config
    checks: memory, lengths, dtypes): that is reported in one line; anything else is a bug, with its traceback."""
    from qarl_cli.rollout.base import build_engine

    try:
        return build_engine(cfg.rollout, weights, scheme, dtype=cfg.model.dtype,
                            seed=cfg.seed, max_model_len=context, device=device, workdir=None,
                            log_dir=run_dir)
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"rollout={cfg.rollout.name} refused to start ({type(e).__name__}: {first}); "
                        "nothing was trained") from e


def _gatherer(dist: Any):
    """The sync's view of a sharded model: its full weights under checkpoint names, streamed to rank 0 a decoder
    layer at a time (as the sync writes its buckets). The other ranks take part in the same gathers here, in step
    with rank 0's reading, and get nothing."""
    def gather(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        from transformers.core_model_loading import revert_weight_conversion

        # a layer's tensors together: the conversion back to checkpoint names (fused experts split) is per layer
        stream = dist.model_state_stream(model, lambda group: revert_weight_conversion(model, group))
        if dist.main:
            return stream
        for _ in stream:
            pass
        return iter(())
    return gather


def _probe(tokenizer: Any, prompts: list[list[int]], problems: list) -> list[list[int]]:
    """Fixed sequences for the sync's verify: test prompts followed by their boxed gold answers."""
    answers = tokenizer([f"\\boxed{{{p.answer}}}" for p in problems], add_special_tokens=False)["input_ids"]
    return [p + a for p, a in zip(prompts, answers)]
