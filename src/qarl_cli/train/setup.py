"""Everything a training run holds, built from the config in one place: model, tokenizer, data, learner, rollout
engine, reward, sync and logger (and, on resume, the checkpoint's weights and trainer state)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from qarl_cli.config.errors import UserError
from qarl_cli.config.root import TrainConfig


@dataclass
class Run:
    cfg: TrainConfig
    run_dir: Path
    source: Path  # the unquantized checkpoint the run started from
    tokenizer: Any
    splits: Any
    learner: Any
    engine: Any
    reward: Any
    sync: Any
    logger: Any
    dist: Any  # train.distributed: Single, or the torchrun ranks
    start_step: int = 0
    resumed_from: Optional[Path] = None
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def model(self) -> torch.nn.Module:
        return self.learner.model

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


def build(cfg: TrainConfig, run_dir: Path, log=print, dist: Any = None) -> Run:
    """dist: train.distributed's view of the ranks (None: one process)."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qarl_cli.data.splits import chat_messages, load_splits
    from qarl_cli.models.hf_eval import prompt_ids
    from qarl_cli.models.resolve import model_dir
    from qarl_cli.objectives import get_objective
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.base import resolve_device
    from qarl_cli.quant.checkpoint import load_meta_model, plan_for
    from qarl_cli.rollout.base import build_engine
    from qarl_cli.rollout.sync import InplaceSync
    from qarl_cli.stages import resolve
    from qarl_cli.train.distributed import MainEngine, MainReward, Single
    from qarl_cli.train.learner import Learner
    from qarl_cli.train.loggers import LOGGERS, NullLogger
    from qarl_cli.train.state import find_resume, load_trainer_state

    dist = dist or Single()
    torch.manual_seed(cfg.seed)
    device = torch.device(resolve_device(cfg.device))
    source = model_dir(cfg.model, log=log)
    ckpt = find_resume(cfg.resume, run_dir)
    weights = ckpt / "model" if ckpt else source
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    splits = load_splits(cfg.data, cfg.seed)
    scheme = build_scheme(cfg.quant, device.type)
    model = AutoModelForCausalLM.from_pretrained(str(weights), dtype=getattr(torch, cfg.model.dtype))
    model = resolve("forward", cfg.forward.name)(cfg.forward, scheme).apply(model.to(device))
    learner = Learner(dist.shard(model), cfg, get_objective(cfg.algorithm.name), device, dist)
    start = load_trainer_state(ckpt, learner)["step"] if ckpt else 0

    stack = contextlib.ExitStack()
    try:
        longest = max(map(len, prompt_ids(tokenizer, [chat_messages(cfg.data, p) for p in splits.test[:256]])))
        try:  # rank 0 runs the engine and the reward; under torchrun the others get what they return
            engine = dist.main_only(lambda: build_engine(
                cfg.rollout, weights, scheme, weights=cfg.sync.mode, dtype=cfg.model.dtype, seed=cfg.seed,
                max_model_len=2 * longest + cfg.max_new_tokens, device=device.type, workdir=None), send=False)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - vLLM's start-up errors are long; say which stage and why
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise UserError(f"rollout={cfg.rollout.name} failed to start ({type(e).__name__}: {first}); "
                            "nothing was trained") from e
        engine = MainEngine(dist, engine) if dist.world > 1 else engine
        stack.callback(engine.close)
        reward = dist.main_only(lambda: resolve("reward", cfg.reward.name)(cfg.reward), send=False)
        reward = MainReward(dist, reward) if dist.world > 1 else reward
        stack.callback(reward.close)
        probe = _probe(tokenizer, cfg, splits.test[:8])
        sync = InplaceSync(cfg.sync, scheme, plan_for(load_meta_model(source), scheme), probe,
                           gather=_gatherer(dist) if dist.world > 1 else None)
        logger = (LOGGERS[cfg.logger.name] if dist.main else NullLogger)(
            cfg.logger, run_dir, OmegaConf.to_container(OmegaConf.structured(cfg)))
        stack.callback(logger.close)
    except BaseException:
        stack.close()
        raise
    return Run(cfg, run_dir, source, tokenizer, splits, learner, engine, reward, sync, logger, dist, start, ckpt,
               stack)


def _gatherer(dist: Any):
    """The sync's view of a sharded model: its full weights under checkpoint names on rank 0, {} elsewhere."""
    def gather(model: torch.nn.Module) -> dict:
        from transformers.core_model_loading import revert_weight_conversion

        full = dist.model_state(model)  # every rank takes part
        return revert_weight_conversion(model, full) if dist.main else {}
    return gather


def _probe(tokenizer: Any, cfg: TrainConfig, problems: list) -> list[list[int]]:
    """Fixed sequences for the sync's verify: test prompts followed by their boxed gold answers."""
    from qarl_cli.data.splits import chat_messages
    from qarl_cli.models.hf_eval import prompt_ids

    prompts = prompt_ids(tokenizer, [chat_messages(cfg.data, p) for p in problems])
    answers = tokenizer([f"\\boxed{{{p.answer}}}" for p in problems], add_special_tokens=False)["input_ids"]
    return [p + a for p, a in zip(prompts, answers)]
