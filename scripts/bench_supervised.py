"""How far can training move the embedded default's starting model within `make train`'s budget?

Continues the warm start's own supervised loss (gold answers of the arith training stream) from the built tiny
model for --steps steps of --batch problems (the warm start's own step) with `qarl train`'s optimizers and
schedule (warmup, then cosine to 10 %; gradient clip 1), and measures the default test split before, halfway and
at the end: greedy accuracy and avg@4 at temperature 1 (Hugging Face sampling of the fp32 model). Supervised
training on the right answers is an upper reference for RL, which learns from its own samples and a 0/1 reward:
if this cannot gain 10 points of avg@4 from a starting model in 180 steps, RL will not either. --final-lr picks
the starting models: the warm start's lr at its end as a fraction of its peak (TinyModelConfig.warm_start_final_lr;
1.0 is the default, 0.1 the annealed one).

    .venv/bin/python scripts/bench_supervised.py [--final-lr 1.0,0.1] [--runs muon:2e-3,adamw:3e-4]
        [--steps 180] [--batch 64] [--out bench_supervised.json]

Prints a markdown table and writes JSON."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from _bench import markdown, table


def measure(model, tok, problems) -> dict:
    import torch

    from qarl_cli.models.hf_eval import greedy_accuracy, sampled_accuracy

    torch.manual_seed(0)
    return {"greedy": greedy_accuracy(model, tok, problems)["accuracy"],
            "avg@4": sampled_accuracy(model, tok, problems, k=4)}


def continue_supervised(src: Path, optimizer: str, lr: float, steps: int, batch: int, progress) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qarl_cli.config.root import TrainConfig
    from qarl_cli.data import arith
    from qarl_cli.models.warm_start import default_test_split, supervised_step
    from qarl_cli.optim import build_optimizer, lr_lambda

    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    test = default_test_split()
    # qarl train's optimizer and schedule, with its default betas, weight decay and warmup
    betas = next(f for f in dataclasses.fields(TrainConfig) if f.name == "betas").default_factory()
    opt = build_optimizer(model, optimizer, lr, tuple(betas), TrainConfig.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(TrainConfig.warmup_steps, steps, "cosine"))
    stream = arith.train_stream(seed=0, levels=[1, 2, 3])
    points = [{"step": 0, **measure(model, tok, test)}]
    task = progress.add_task(f"{src.name} {optimizer} {lr:g}", total=steps)
    for step in range(1, steps + 1):
        model.train()
        supervised_step(model, tok, opt, sched, [next(stream) for _ in range(batch)])  # the warm start's step
        progress.advance(task)
        if step in (steps // 2, steps):
            points.append({"step": step, **measure(model, tok, test)})
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--final-lr", default="1.0,0.1", help="starting models: warm_start_final_lr values")
    ap.add_argument("--runs", default="muon:2e-3,adamw:3e-4", help="optimizer:lr pairs")
    ap.add_argument("--steps", type=int, default=180)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench_supervised.json"))
    args = ap.parse_args()
    import torch
    from rich.progress import Progress

    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model

    torch.set_num_threads(2)
    rows, results, start = [], [], time.perf_counter()
    with Progress() as progress:
        for final in (float(x) for x in args.final_lr.split(",")):
            src = ensure_tiny_model(TinyModelConfig(warm_start_final_lr=final), log=progress.console.print)
            for run in args.runs.split(","):
                optimizer, lr = run.split(":")
                points = continue_supervised(src, optimizer, float(lr), args.steps, args.batch, progress)
                results.append({"warm_start_final_lr": final, "optimizer": optimizer, "lr": float(lr),
                                "points": points})
                first, mid, last = points
                rows.append({"start model (final lr)": final, "optimizer": f"{optimizer} {lr}",
                             "avg@4 start": f"{first['avg@4']:.1%}", f"avg@4 @{mid['step']}": f"{mid['avg@4']:.1%}",
                             f"avg@4 @{last['step']}": f"{last['avg@4']:.1%}",
                             "gain": f"{100 * (last['avg@4'] - first['avg@4']):+.1f}",
                             "greedy": f"{first['greedy']:.1%} -> {last['greedy']:.1%}"})
    table(f"supervised training on gold answers, {args.steps} steps x {args.batch}", rows)
    print(markdown(rows))
    args.out.write_text(json.dumps({"steps": args.steps, "batch": args.batch, "results": results,
                                    "seconds": round(time.perf_counter() - start, 1)}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
