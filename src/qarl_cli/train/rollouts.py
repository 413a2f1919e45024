"""The rollout stage as the loop sees it: the batch of each step, generated when the step asks for it
(`rollout.max_staleness=0`) or ahead of it, while the trainer works on earlier ones (k > 0).

With k > 0 the batches of the next k steps are generated in a background thread, in step order, with the weights
the engine holds when each starts: the batch of step t+1 is sampled while step t trains, so it comes from the
policy one update behind the one that trains on it (staleness 1). Before every weight sync (and evaluation) the
loop waits for what is in flight (`settle`), so an engine never changes weights mid-generation. Every batch carries
the weight version that produced it (`meta["weight_version"]`, one per sample); the objectives correct the lag
through the rollout/old ratio they already use for quantization mismatch (docs/objectives.md).

Under torchrun rank 0 alone generates: its thread calls rank 0's engine itself (no collective leaves the thread), and
the batch is broadcast when the step takes it, from the main thread, where every rank is in step; the other ranks
draw the same problems and wait in that broadcast.

Which problems and which sampling seed a step gets depend on the step alone, so k = 0 is exactly the synchronous
loop, and resume is exact for it. For k > 0 a checkpoint also records the batches generated ahead of it
(`in_flight`: problems, prompts, samples and the weight version that made them), and a resumed run takes those
instead of generating them again with the checkpoint's newer weights: its staleness, batches and weights are the
uninterrupted run's."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator, Optional


@dataclass
class Taken:
    problems: list
    prompts: list[list[int]]
    batch: Any  # RolloutBatch
    version: int  # weight version that generated it
    wait_s: float  # how long the step waited for it


class Rollouts:
    def __init__(self, run: Any, stream: Iterator, start_step: int, version: int = 0,
                 saved: Optional[dict] = None) -> None:
        """saved: what a checkpoint's `record()` wrote (its in-flight steps' problems are not in `stream`)."""
        from qarl_cli.update.distributed import MainEngine

        self.run, self.stream, self.k = run, stream, run.cfg.rollout.max_staleness
        self.version = version  # weights the engine serves: bumped by the loop after each sync
        self.next_step = start_step  # the first step whose problems are not drawn yet
        self.pending: dict[int, tuple[list, list, Future, int]] = {}
        self.dist = run.dist
        # the thread runs only where the engine is (rank 0); it must not call MainEngine, whose calls are collectives
        self.pool: Optional[ThreadPoolExecutor] = (ThreadPoolExecutor(1, "qarl-rollout")
                                                   if self.k and self.dist.main else None)
        self.local = run.engine.engine if isinstance(run.engine, MainEngine) else run.engine
        if saved:
            self.version = saved["version"]
        for rec in (saved or {}).get("in_flight", []):  # generated before the checkpoint, by rec["version"]
            done: Future = Future()
            done.set_result(rec["batch"] if self.dist.main else None)
            self.pending[rec["step"]] = (rec["problems"], rec["prompts"], done, rec["version"])
            self.next_step = rec["step"] + 1

    def record(self) -> dict:
        """What a checkpoint keeps: the weight version and the batches generated ahead of the next step, settled."""
        self.settle()
        return {"version": self.version, "in_flight": [
            {"step": step, "problems": problems, "prompts": prompts, "version": version,
             "batch": future.result() if self.dist.main else None}
            for step, (problems, prompts, future, version) in sorted(self.pending.items())]}

    def _generate(self, step: int, prompts: list[list[int]], engine: Any = None):
        cfg = self.run.cfg
        return (engine or self.run.engine).generate(prompts, cfg.samples_per_prompt, cfg.temperature, cfg.top_p,
                                                    cfg.max_new_tokens, seed=cfg.seed * 1_000_003 + step)

    def _start(self, step: int) -> None:
        assert step == self.next_step, (step, self.next_step)  # problems are drawn in step order
        problems = [next(self.stream) for _ in range(self.run.cfg.prompts_per_step)]
        prompts = self.run.encode(problems)
        future: Future = Future()
        if self.pool is None:
            future.set_result(None)  # generated in take(), synchronously (k = 0), or by rank 0 (k > 0, other ranks)
        else:
            future = self.pool.submit(self._generate, step, prompts, self.local)
        self.pending[step] = (problems, prompts, future, self.version)
        self.next_step += 1

    def take(self, step: int, last_step: int) -> Taken:
        """Step `step`'s batch; with k > 0, first starts the batches of steps up to step + k (before last_step)."""
        if step not in self.pending:
            self._start(step)
        for ahead in range(self.next_step, min(step + self.k, last_step - 1) + 1):
            self._start(ahead)
        problems, prompts, future, version = self.pending.pop(step)
        start = time.perf_counter()
        if self.k:  # rank 0's thread generated it; every rank gets it (one process: the result itself)
            batch = self.dist.main_only(future.result)
        else:
            batch = self._generate(step, prompts)
        batch.meta["weight_version"] = [version] * len(batch)
        return Taken(problems, prompts, batch, version, time.perf_counter() - start)

    def settle(self) -> None:
        """Wait until nothing is being generated (before the engine's weights change, or it evaluates)."""
        for _, _, future, _ in self.pending.values():
            future.exception()  # waits; an error is raised when its step takes the batch

    def weights_updated(self) -> None:
        self.version += 1

    def close(self) -> None:
        """Wait for a generation in flight (the engine must not close under it), then stop the thread."""
        if self.pool is not None:
            for _, _, future, _ in self.pending.values():
                future.cancel() or future.exception()
            self.pool.shutdown(wait=True)
            self.pool = None
