"""Checkpoints of a training run: `<run dir>/checkpoints/step_<N>/` holds `model/` (a Hugging Face checkpoint with
the tokenizer: `qarl eval model=hf model.path=...` takes it as it is) and `trainer.pt` (optimizer, schedule, RNG
states, step; the data position is the step). Each is written into a hidden temporary directory and renamed into
place when complete, so a run killed at any moment leaves only complete checkpoints behind."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from qarl_cli.config.errors import ConfigError, UserError

from qarl_cli.train.rundir import PREFIX, find_resume, intact, latest  # noqa: F401 - torch-free, shared


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{PREFIX}{step:06d}"


def checkpoint_step(ckpt: Path) -> int:
    """The step checkpoint `ckpt` was written at: from its directory's name (step_<N>, as checkpoint_dir names
    it), else from its trainer.pt (memory-mapped: only the small step field is read)."""
    name = ckpt.name
    if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
        return int(name[len(PREFIX):])
    try:
        return int(torch.load(ckpt / "trainer.pt", weights_only=False, mmap=True, map_location="cpu")["step"])
    except Exception as e:  # noqa: BLE001 - any unreadable trainer state is the checkpoint's fault
        raise ConfigError(f"resume={str(ckpt)!r}: {ckpt / 'trainer.pt'} cannot be read ({type(e).__name__}); "
                          "resume from another checkpoint") from None


def check_steps_left(ckpt: Path, steps: int, dry_run: bool = False) -> None:
    """ConfigError unless checkpoint `ckpt` stopped below `steps`: a resume asking for no more steps than the
    checkpoint has done would load the model and the engine, then end without a word."""
    done = checkpoint_step(ckpt)
    if done < steps:
        return
    further = f"set steps above {done} to train further" + (" (dry_run=true runs 1 step)" if dry_run else "")
    how = (f"has done all steps={steps}: nothing to train; {further}" if done == steps
           else f"has done {done} steps and steps={steps} asks for fewer: {further}")
    raise ConfigError(f"resume: checkpoint {ckpt} {how}")


def save(run_dir: Path, step: int, model: torch.nn.Module, learner: Any, source: Path, extra: dict) -> Path:
    """Write checkpoint `step` atomically; returns its directory. Distributed: every rank calls this (the full
    weights and optimizer state are gathered on rank 0, which writes them)."""
    final = checkpoint_dir(run_dir, step)
    weights = learner.dist.model_state(model)  # None in one process: the model holds them
    optimizer = learner.dist.optimizer_state(model, learner.optimizer)
    if not learner.dist.main:
        return final
    from qarl_cli.models.integrity import require_finite  # a diverged run's weights: nothing is written

    require_finite((model.state_dict() if weights is None else weights).items(), f"checkpoint {final} not "
                   "written", "; the training diverged: resume from an earlier checkpoint with a lower lr")
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp / "model", **({} if weights is None else {"state_dict": weights}))
        from qarl_cli.quant.checkpoint import copy_side_files

        copy_side_files(source, tmp / "model")  # tokenizer, chat template (not the source's weights or config)
        torch.save({"step": step, "optimizer": optimizer, "world": learner.dist.world,
                    "scheduler": learner.scheduler.state_dict(), "skipped": learner.skipped,
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}, **extra},
                   tmp / "trainer.pt")
        from qarl_cli.train.rundir import CONFIG, config_dict

        (tmp / CONFIG).write_text(json.dumps(config_dict(learner.cfg), indent=1) + "\n")  # what resume checks
        from qarl_cli.machine.scratch import publish

        publish(tmp, final, replace=True)  # an older step_N (a resume from before it) is swapped, never missing
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        from qarl_cli.machine.disk import disk_full

        if disk_full(e):
            raise DiskFull(final, latest(run_dir)) from e
        raise
    from qarl_cli.train.rundir import drop_replaced

    drop_replaced(run_dir)  # this run's first checkpoint: the run overwrite=true replaced is no longer needed
    return final


class DiskFull(UserError):
    """A checkpoint write that ran out of space: named as such, with the checkpoint that is intact."""

    def __init__(self, final: Path, intact: Optional[Path]) -> None:
        self.final, self.intact = final, intact
        run_dir = final.parent.parent
        kept = (f"{intact.name} is intact; resume with resume={run_dir} once there is room" if intact is not None
                else "no earlier checkpoint exists")
        super().__init__(f"no space left on the device at {final.parent}; {final.name} was not written; {kept}")


def load_trainer_state(ckpt: Path, learner: Any) -> dict:
    """Restore optimizer, schedule and RNG from `ckpt`; returns the saved dict (step, extra fields)."""
    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    if state.get("world", 1) != learner.dist.world:
        raise ConfigError(f"resume={str(ckpt)!r}: written by {state.get('world', 1)} ranks, resumed on "
                          f"{learner.dist.world}; resume with the same number of ranks")
    learner.dist.load_optimizer_state(learner.model, learner.optimizer, state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    learner.skipped = state["skipped"]
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state
