"""Supervised warm start of a tiny model on generated arithmetic: teaches the answer format (\\boxed{N}, or for
model=tiny_cot the worked solution that ends in it) and some arithmetic, and stops early on purpose, so that RL
starts from a model that is right only sometimes and still learning (by default its learning rate is not
annealed: see TinyModelConfig.warm_start_final_lr).

How far a fixed number of seeded steps gets depends on the CPU (AVX2 and AVX-512 kernels round differently, and
the differences compound), so after its configured steps the warm start measures greedy accuracy on a held-out
split and trains on in fixed chunks until it is inside the target band (TinyModelConfig.warm_start_target_band)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from qarl_cli.config.data import ArithCotDataConfig, ArithDataConfig, ArithSumDataConfig
from qarl_cli.config.model import TinyModelConfig
from qarl_cli.data import arith, arith_cot
from qarl_cli.data.base import Problem
from qarl_cli.models.hf_eval import greedy_accuracy, prompt_ids, user_messages
from qarl_cli.models.tokenizer import BOXED
from qarl_cli.optim import MuonAdamW, lr_lambda


def boxed_answer(p: Problem) -> str:
    return f"{BOXED}{p.answer}}}"


@dataclass(frozen=True)
class Task:
    """What a tiny model is warm-started on: its training stream, the response it learns to write, its test split
    (as `qarl train` evaluates it by default) and a held-out split of `n` problems disjoint from both."""

    stream: Callable[[int], Iterator[Problem]]  # seed -> training problems
    response: Callable[[Problem], str]
    test: Callable[[], list[Problem]]
    heldout: Callable[[int], list[Problem]]
    max_new_tokens: int


def _arith_test() -> list[Problem]:
    return arith.test_split(ArithDataConfig.test_size, ArithDataConfig().levels)


def _arith_heldout(size: int) -> list[Problem]:
    return arith.test_split(ArithDataConfig.test_size + size, ArithDataConfig().levels)[ArithDataConfig.test_size:]


def _cot_task(cfg: ArithCotDataConfig) -> "Task":
    """A worked-solution task as data=NAME's defaults draw it (arith_cot, arith_sum)."""
    kw = {"operators": cfg.operators, "source": cfg.name}

    def heldout(size: int) -> list[Problem]:
        return arith_cot.test_split(cfg.test_size + size, cfg.ops, **kw)[cfg.test_size:]

    return Task(lambda seed: arith_cot.train_stream(seed, cfg.ops, **kw), lambda p: arith_cot.solution(p.prompt),
                lambda: arith_cot.test_split(cfg.test_size, cfg.ops, **kw), heldout, cfg.max_new_tokens)


TASKS = {
    # Level 1 twice as often: it is where the model first learns to read digits, which the others build on.
    "arith": Task(lambda seed: arith.train_stream(seed=seed, levels=[1, 1, 2, 3]), boxed_answer, _arith_test,
                  _arith_heldout, ArithDataConfig.max_new_tokens),
    "arith_cot": _cot_task(ArithCotDataConfig()),
    "arith_sum": _cot_task(ArithSumDataConfig()),
}


def supervised_batch(tok, problems: Sequence[Problem], response: Callable[[Problem], str] = boxed_answer):
    """(input_ids, labels, attention_mask) of the prompts answered with `response` (by default the gold
    `\\boxed{N}`) and EOS, the loss on the answer only, right-padded: the warm start's batch (and
    scripts/bench_supervised.py's)."""
    import torch

    seqs, labels = [], []
    for ids, p in zip(prompt_ids(tok, user_messages(list(problems))), problems):
        resp = tok(response(p), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(ids + resp)
        labels.append([-100] * len(ids) + resp)  # loss on the response only
    width = max(map(len, seqs))
    pad = tok.pad_token_id
    return (torch.tensor([s + [pad] * (width - len(s)) for s in seqs]),
            torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
            torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]))


def supervised_step(model, tok, opt, sched, problems: Sequence[Problem],
                    response: Callable[[Problem], str] = boxed_answer) -> float:
    """One step of the supervised loss on `problems` (gradient clipped to norm 1, then the optimizer and the
    schedule); returns the loss. The model must be in train mode."""
    import torch

    ids, labels, mask = supervised_batch(tok, problems, response)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.item()


def default_test_split(task: str = "arith") -> list[Problem]:
    """The task's test split as `qarl train` evaluates it by default (the data schema's size and levels)."""
    return TASKS[task].test()


def heldout_split(size: int, task: str = "arith") -> list[Problem]:
    """`size` test-class problems (never in a training stream) that come after the default test split in its own
    sequence: disjoint from it, so that checking the band selects nothing on the problems RL is measured on."""
    return TASKS[task].heldout(size)


def train_until_in_band(train: Callable[[int], None], measure: Callable[[], float], steps: int, chunk: int,
                        max_steps: int, band: Sequence[float]) -> dict:
    """Train `steps`, measure; while the accuracy is below the band and fewer than `max_steps` are done, train
    `chunk` more (the last chunk cut to the budget) and measure again. Above the band it stops: more training
    would not bring it down. Returns the steps done, the last accuracy, every check and whether it is in band."""
    lo, hi = band
    train(steps)
    done, acc = steps, measure()
    checks = [{"steps": done, "accuracy": acc}]
    while acc < lo and done < max_steps:
        n = min(chunk, max_steps - done)
        train(n)
        done, acc = done + n, measure()
        checks.append({"steps": done, "accuracy": acc})
    return {"steps": done, "heldout_accuracy": acc, "checks": checks, "in_band": lo <= acc <= hi}


def warm_start(model, tok, cfg: TinyModelConfig, log: Callable[[str], None]) -> dict:
    import torch
    from rich.progress import Progress

    task = TASKS[cfg.task]
    torch.manual_seed(cfg.build_seed)
    stream = task.stream(cfg.build_seed)
    # AdamW alone needs ~10x the steps here. The AdamW part at the full lr with betas (0.9, 0.98): the recipe the
    # default model was built with (qarl train's muon differs: AdamW part at lr / 5, betas from its config).
    opt = MuonAdamW(model, cfg.warm_start_lr, adamw_lr_ratio=1.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(max(1, cfg.warm_start_steps // 20), cfg.warm_start_steps,
                                                             "cosine", final=cfg.warm_start_final_lr))
    heldout = task.heldout(cfg.warm_start_check_size)
    start, loss = time.time(), float("nan")
    with Progress(transient=True) as progress:
        bar = progress.add_task("warm start", total=0)

        def train(steps: int) -> None:
            nonlocal loss
            progress.update(bar, total=progress.tasks[0].total + steps)
            model.train()
            for _ in range(steps):
                loss = supervised_step(model, tok, opt, sched, [next(stream) for _ in range(cfg.warm_start_batch)],
                                       task.response)
                progress.update(bar, advance=1, description=f"warm start (loss {loss:.3f})")

        measure = lambda: greedy_accuracy(model, tok, heldout, task.max_new_tokens)["accuracy"]  # noqa: E731
        run = train_until_in_band(train, measure, cfg.warm_start_steps, cfg.warm_start_chunk_steps,
                                  cfg.warm_start_max_steps, cfg.warm_start_target_band)
    seconds = time.time() - start
    acc = greedy_accuracy(model, tok, task.test(), task.max_new_tokens)
    lo, hi = cfg.warm_start_target_band
    log(f"[qarl] warm start: {run['steps']} steps in {seconds:.0f} s, final loss {loss:.3f}, greedy accuracy "
        f"{run['heldout_accuracy']:.1%} held out (band {lo:.0%}-{hi:.0%}), {acc['accuracy']:.1%} on the test split")
    if not run["in_band"]:
        log(f"[qarl] warning: the warm start ended outside its band after {run['steps']} steps "
            f"(warm_start_max_steps={cfg.warm_start_max_steps}); RL may have little to learn from")
    return {**run, "seconds": round(seconds, 1), "final_loss": loss, **acc}
