"""The RL loop of docs/design.md ("One training step"). It only calls stages:

    rollout -> reward -> advantages -> aligned forward at theta_old -> minibatch updates -> sync

timing each, evaluating on the test split every `eval_every` steps and checkpointing every `checkpoint_every`.
What each stage is comes from the config (setup.build). A stage that fails mid-run stops the run with one line
naming it, after a final checkpoint of the last step whose update is in the weights."""

from __future__ import annotations

import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qarl_cli.config.errors import UserError
from qarl_cli.config.root import TrainConfig


class StageFailed(UserError, RuntimeError):
    """A stage raised mid-run; the run stopped after writing a final checkpoint."""


def train(cfg: TrainConfig, run_dir: Path, dist: Any = None) -> int:
    """dist: train.distributed's view of the torchrun ranks (None: one process); rank 0 prints and logs."""
    from qarl_cli.train import report, setup, state

    console = Console(markup=False, highlight=False, quiet=bool(dist and not dist.main))
    run = setup.build(cfg, run_dir, log=console.print, dist=dist)
    with run, Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=console, transient=True) as bar:
        task = bar.add_task("train", total=cfg.steps, completed=run.start_step)
        fresh = not run.resumed_from and cfg.eval_every
        history = report.evaluate_now(run, run.start_step, console) if fresh else []
        stream = run.splits.train_stream(start=run.start_step * cfg.prompts_per_step)
        tracker = _Tracker(run.start_step)
        try:
            for step in range(run.start_step, cfg.steps):
                metrics, samples = one_step(run, step, stream, tracker)
                done = step + 1
                if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
                    with tracker.stage("eval"):
                        history += report.evaluate_now(run, done, console, metrics)
                run.logger.log(done, metrics, samples)
                bar.console.print(report.step_line(done, cfg.steps, metrics))
                if not cfg.dry_run and (done == cfg.steps or cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                    state.save(run_dir, done, run.model, run.learner, run.source, {})
                bar.update(task, completed=done)
        except Exception as e:  # noqa: BLE001 - any stage: report it in one line, keep what the run learned
            raise _stopped(run, tracker, e) from e
    if run.dist.main:
        report.final_table(console, history, run_dir)
    return 0


def one_step(run: Any, step: int, stream: Iterator, tracker: "_Tracker") -> tuple[dict, list]:
    from qarl_cli.data.splits import chat_messages
    from qarl_cli.mismatch import mismatch_metrics
    from qarl_cli.models.hf_eval import prompt_ids
    from qarl_cli.train.collect import collect

    cfg, start = run.cfg, time.perf_counter()
    tracker.times.clear()
    problems = [next(stream) for _ in range(cfg.prompts_per_step)]
    prompts = prompt_ids(run.tokenizer, [chat_messages(cfg.data, p) for p in problems])
    with tracker.stage("rollout"):
        batch = run.engine.generate(prompts, cfg.samples_per_prompt, cfg.temperature, cfg.top_p,
                                    cfg.max_new_tokens, seed=cfg.seed * 1_000_003 + step)
    with tracker.stage("reward"):
        got = collect(batch, prompts, problems, run.tokenizer, run.reward, cfg.samples_per_prompt,
                      cfg.max_new_tokens, cfg.algorithm)
    metrics = dict(got.metrics)
    if got.keep.any():  # groups whose samples all got the same reward carry no signal: not trained on
        seqs = got.seqs.select(got.keep.nonzero()[:, 0])
        with tracker.stage("forward"):
            old = run.learner.old_logprobs(seqs) if run.learner.needs_old_pass else None
        with tracker.stage("update"):
            updated, old = run.learner.update(seqs, old, got.advantages[got.keep], cfg.algorithm,
                                              seed=cfg.seed * 7919 + step)
        tracker.trained = step + 1
        metrics.update({**updated, **mismatch_metrics(old, seqs.rollout_logprobs, seqs.mask,
                                                      cfg.algorithm.mismatch_cap)})
    with tracker.stage("sync"):
        metrics.update(run.sync.push(run.model, run.engine))
    tracker.trained = step + 1
    return {**metrics, **{f"time/{k}": v for k, v in tracker.times.items()},
            "time/step": time.perf_counter() - start}, got.samples


class _Tracker:
    """Which stage runs now, how long each took this step, and the last step whose update is in the weights."""

    def __init__(self, trained: int) -> None:
        self.trained = trained
        self.current = "setup"
        self.times: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        self.current, start = name, time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


def _stopped(run: Any, tracker: _Tracker, error: Exception) -> StageFailed:
    """Write the traceback and a final checkpoint; the one-line error that ends the run."""
    from qarl_cli.train import state

    log = run.run_dir / ("error.log" if run.dist.main else f"error.rank{run.dist.rank}.log")
    log.write_text(traceback.format_exc())
    where = f"stage {tracker.current} failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    try:
        if run.cfg.dry_run or tracker.trained == 0:
            saved = "no checkpoint (nothing trained yet)"
        else:
            saved = f"checkpoint {state.save(run.run_dir, tracker.trained, run.model, run.learner, run.source, {})}"
    except Exception as e:  # noqa: BLE001
        saved = f"the final checkpoint failed too ({type(e).__name__}: {e})"
    return StageFailed(f"{where}; {saved}; traceback in {log}; resume with "
                       f"resume={run.run_dir}")
