"""`qarl train`: the RL loop (qarl_cli.train.loop) on the configured stages.

dry_run=true builds every stage and runs one small step (4 prompts x 2 samples, 16 new tokens), without
evaluation or checkpoints: a cheap check of a config's code path, e.g. a paper-scale experiment preset on the tiny
MoE model. Where this machine cannot run the preset's choice, the dry run says so and substitutes: the CPU for a
missing GPU, and the embedded engine (same quantized modules) for a scheme vLLM cannot serve here
(qarl_cli.machine.capabilities). A run that is not a dry run refuses such a scheme in one line instead."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from qarl_cli.config.root import TrainConfig


def check_paths(cfg: TrainConfig, run_dir: Path) -> None:
    """At compose time, before Hydra creates or writes the run directory (train.rundir.check_paths)."""
    from qarl_cli.train import rundir

    rundir.check_paths(run_dir, cfg)


def run(cfg: TrainConfig, run_dir: Path) -> int:
    from qarl_cli.quant.base import resolve_device
    from qarl_cli.update.distributed import from_env
    from qarl_cli.train.loop import train

    from qarl_cli.machine.capabilities import require_served

    cfg = dry(cfg) if cfg.dry_run else cfg
    require_served(cfg)  # a scheme vLLM cannot serve here: one line now, not a vLLM traceback minutes later
    from qarl_cli.forward.routing import check_config

    check_config(cfg)  # rollout.routing_replay=true for a dense model: one line now
    dist = from_env(resolve_device(cfg.device))  # torchrun: one process group for the run
    try:
        run_dir = dist.broadcast(run_dir)  # every rank works in rank 0's run directory, which rank 0 owns
        dist.main_only(lambda: own(run_dir, cfg))
        return recorded(run_dir, dist.main, lambda: train(cfg, run_dir, dist))
    finally:
        dist.close()


def recorded(run_dir: Path, main: bool, body) -> int:
    """Run `body` and write how it ended into the run directory's status.json (rank 0): finished, failed (and
    why, in one line) or interrupted. A sweep's summary and `qarl compare` read it."""
    from qarl_cli.config.errors import UserError
    from qarl_cli.results.runs import FAILED, FINISHED, INTERRUPTED, write_status
    from qarl_cli.train.failures import Interrupted

    from qarl_cli.train import rundir

    try:
        code = body()
    except BaseException as e:
        aside = sorted(run_dir.glob(f"{rundir.ASIDE}*")) if main else []
        if aside:  # no checkpoint of this run yet: the run overwrite=true replaces is still whole
            print(f"qarl train: the run that overwrite=true replaced is kept in {aside[-1]}", file=sys.stderr)
        if main:
            stopped = isinstance(e, (Interrupted, KeyboardInterrupt, SystemExit))
            first = (str(e).strip().splitlines() or [""])[0]
            why = first if isinstance(e, UserError) and first else f"{type(e).__name__}: {first}".rstrip(": ")
            write_status(run_dir, INTERRUPTED if stopped else FAILED, why)
        raise
    if main:
        write_status(run_dir, FINISHED)
        rundir.drop_replaced(run_dir)
    return code


def own(run_dir: Path, cfg: TrainConfig) -> None:
    """This process's run directory: locked for the run; a fresh run does not write over another's results."""
    from qarl_cli.train import rundir

    rundir.claim(run_dir)
    rundir.remove_partial_checkpoints(run_dir)
    if not cfg.resume:
        rundir.check_fresh(run_dir, cfg.overwrite)  # again, now under the lock
        if cfg.overwrite:
            rundir.set_aside(run_dir)


def dry(cfg: TrainConfig) -> TrainConfig:
    import torch

    from qarl_cli.machine.capabilities import engine_serving
    from qarl_cli.config.stages import TorchRolloutConfig

    changes: dict = dict(steps=1, prompts_per_step=min(cfg.prompts_per_step, 4),
                         samples_per_prompt=min(cfg.samples_per_prompt, 2), minibatches=1, epochs_per_step=1,
                         eval_every=0, checkpoint_every=0, max_new_tokens=min(cfg.max_new_tokens, cfg.DRY_RUN_NEW_TOKENS))
    notes = []
    if cfg.device == "cuda" and not torch.cuda.is_available():
        changes["device"] = "cpu"
        notes.append("device=cpu (no CUDA here)")
    on_cpu = changes.get("device", cfg.device) == "cpu" or not torch.cuda.is_available()
    serving = engine_serving(dataclasses.replace(cfg, device=changes.get("device", cfg.device)))
    if serving is not None and not serving.served:
        changes["rollout"] = TorchRolloutConfig()
        notes.append(f"rollout=torch ({serving.reason})")
    elif cfg.rollout.name == "vllm_server" and on_cpu and not cfg.rollout.urls:
        # The topology as configured (its servers, over HTTP, weights through the RL API), each on this CPU.
        # nccl moves weights between GPUs: here the network backend closest to it (a group per server, over TCP)
        backend = "qarl_gloo" if cfg.rollout.transfer_backend == "nccl" else cfg.rollout.transfer_backend
        changes["rollout"] = dataclasses.replace(cfg.rollout, max_model_len=None, tensor_parallel_size=1,
                                                 enable_expert_parallel=False, devices=[], transfer_backend=backend)
        notes.append(f"{cfg.rollout.num_servers} vLLM server(s) on the CPU, tensor_parallel_size=1"
                     + (", transfer_backend=qarl_gloo (nccl needs GPUs)" if backend != cfg.rollout.transfer_backend
                        else ""))
    elif cfg.rollout.name in ("vllm", "vllm_server"):
        changes["rollout"] = dataclasses.replace(cfg.rollout, max_model_len=None)
    skipped = ["evaluation", "checkpoints"]
    if _unbuilt_tiny(cfg.model):  # its warm start takes minutes; the code path is the same without it
        changes["model"] = dataclasses.replace(cfg.model, warm_start_steps=0)
        skipped.append(f"{cfg.model.name}'s warm start (not built yet: its random init instead)")
    print(f"[qarl] dry run: 1 step of {changes['prompts_per_step']} prompts x {changes['samples_per_prompt']} "
          f"samples, {changes['max_new_tokens']} new tokens" + (f"; {', '.join(notes)}" if notes else "")
          + f"; skipped: {', '.join(skipped)}")
    return dataclasses.replace(cfg, **changes)


def _unbuilt_tiny(model_cfg) -> bool:
    """A built-in tiny model with a warm start that is neither in the cache nor shipped with qarl."""
    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import cache_path, is_complete, shipped_build

    return (isinstance(model_cfg, TinyModelConfig) and not model_cfg.path and model_cfg.warm_start_steps > 0
            and not is_complete(cache_path(model_cfg)) and shipped_build(model_cfg) is None)
