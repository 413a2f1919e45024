"""The RL loop of docs/design.md ("One training step"). It only calls stages:

    rollout -> reward -> advantages -> aligned forward at theta_old -> minibatch updates -> sync

timing each, evaluating on the test split every `eval_every` steps and checkpointing every `checkpoint_every`.
What each stage is comes from the config (setup.build). Whatever stops the run (a stage's error, Ctrl-C, SIGTERM),
the last step whose update is in the weights is checkpointed first (train.failures says what is reported)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from qarl_cli.config.root import TrainConfig


def train(cfg: TrainConfig, run_dir: Path, dist: Any = None) -> int:
    """dist: train.distributed's view of the torchrun ranks (None: one process); rank 0 prints and logs."""
    from qarl_cli.train import failures, report, setup, state

    console = Console(markup=False, highlight=False, soft_wrap=True, quiet=bool(dist and not dist.main))
    run = setup.build(cfg, run_dir, log=console.print, dist=dist)
    with run, Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=console, transient=True) as bar:
        task = bar.add_task("train", total=cfg.steps, completed=run.start_step)
        tracker = _Tracker(run.start_step)
        try:
            fresh = not run.resumed_from and cfg.eval_every
            with tracker.stage("eval"):
                history = report.evaluate_now(run, run.start_step, console) if fresh else []
            with tracker.stage("sync"):  # engine and trainer on the same weights: the sync's baselines
                if line := run.sync.calibrate(run.model, run.engine):
                    console.print(f"[qarl] {line}")
            from qarl_cli.train.rollouts import Rollouts

            saved = run.rollouts_saved or {}
            ahead = len(saved.get("in_flight", []))  # batches the checkpoint had generated: their problems are drawn
            if run.resumed_from and cfg.rollout.max_staleness and not saved:
                console.print(f"[qarl] resume: {run.resumed_from.name} was written on a stop and holds no batches "
                              "generated ahead; they are generated again with its weights (staleness 0 at the "
                              "first step, where the unbroken run had 1)")
            rollouts = Rollouts(run, run.splits.train_stream(start=(run.start_step + ahead) * cfg.prompts_per_step),
                                run.start_step, version=run.start_step, saved=saved)
            run.stack.callback(rollouts.close)  # before the engine closes: it waits for a generation in flight
            for step in range(run.start_step, cfg.steps):
                metrics, samples = one_step(run, step, rollouts, tracker)
                done = step + 1
                evaluated = cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps)
                if evaluated:
                    with tracker.stage("eval"):
                        history += report.evaluate_now(run, done, console, metrics)
                run.logger.log(done, metrics, samples)
                if evaluated and done < cfg.steps:  # the curves so far (the last step's are drawn at the end)
                    report.draw_curves(run, console)
                bar.console.print(report.step_line(done, cfg.steps, metrics))
                if not cfg.dry_run and (done == cfg.steps or cfg.checkpoint_every and done % cfg.checkpoint_every == 0):
                    with tracker.stage("checkpoint"):
                        state.save(run_dir, done, run.model, run.learner, run.source,
                                   {"rollouts": rollouts.record()})
                    tracker.saved = done
                bar.update(task, completed=done)
        except BaseException as e:  # noqa: BLE001 - keep what the run learned, then say what stopped it
            known = failures.stopped(run, tracker.current, tracker.trained, tracker.saved, e)
            if known is None:  # a bug: its own traceback
                raise
            raise known from e
    if run.dist.main:
        report.final_table(console, history, run_dir)
        report.draw_curves(run, console)
    return 0


def one_step(run: Any, step: int, rollouts: Any, tracker: "_Tracker") -> tuple[dict, list]:
    from qarl_cli.update.advantages import step_advantages
    from qarl_cli.train.collect import score
    from qarl_cli.update.sequences import pack

    cfg, start = run.cfg, time.perf_counter()
    tracker.times.clear()
    with tracker.stage("rollout"):  # generated now, or ahead while earlier steps trained (rollout.max_staleness)
        taken = rollouts.take(step, cfg.steps)
    problems, prompts, batch = taken.problems, taken.prompts, taken.batch
    with tracker.stage("reward"):
        scored = score(batch, problems, run.tokenizer, run.reward, cfg.max_new_tokens)
    advantages, keep = step_advantages(scored.rewards, cfg.samples_per_prompt, cfg.algorithm)
    metrics = {**scored.metrics, "advantage/signal_frac": keep.float().mean().item(),
               "rollout/weight_version": float(taken.version),
               "rollout/staleness_mean": float(rollouts.version - taken.version),
               "time/rollout_wait": taken.wait_s, "time/rollout_generate": batch.seconds}
    updated = 0
    if keep.any():  # groups whose samples all got the same reward carry no signal: not trained on
        seqs = pack(prompts, batch, run.tokenizer.pad_token_id or 0).select(keep.nonzero()[:, 0])
        run.engine.sleep()  # colocated on a GPU: the update gets the engine's memory (elsewhere a no-op)
        try:
            with tracker.stage("forward"):
                # one on-policy update: its own first forward of each row is pi_old, no separate pass needed
                old = run.learner.old_logprobs(seqs) if run.learner.needs_old_pass else None
            with tracker.stage("update"):
                metrics.update(run.learner.update(seqs, old, advantages[keep], cfg.algorithm,
                                                  seed=cfg.seed * 7919 + step))
        finally:
            run.engine.wake_up()  # awake for the sync, the evaluation and the next rollout
        updated = int(metrics["update/optimizer_steps"])
    run.learner.end_step()  # the schedule follows RL steps, signal or not
    rollouts.settle()  # the engine's weights change only between generations
    if updated:  # unchanged weights are not pushed again
        with tracker.stage("sync"):
            metrics.update(run.sync.push(run.model, run.engine))
    rollouts.weights_updated()  # the version counts steps: a step without an update keeps its weights
    tracker.trained = step + 1
    return {**metrics, **{f"time/{k}": v for k, v in tracker.times.items()},
            "time/step": time.perf_counter() - start}, scored.samples


class _Tracker:
    """Which stage runs now, how long each took this step, the last step whose update is in the weights, and
    the last step checkpointed."""

    def __init__(self, trained: int) -> None:
        self.trained = self.saved = trained
        self.current = "setup"
        self.times: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str):
        from qarl_cli.machine import signals

        signals.check()  # a Ctrl-C whose exception a library swallowed still stops the run here
        self.current, start = name, time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
