"""`qarl eval`: accuracy (avg@k, pass@k), response length and error-token rates of a checkpoint on a dataset's
test split, sampled through the configured rollout engine with the configured quantization. Prints a table and
writes eval.json in the run directory. With no arguments: the embedded tiny model on arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qarl_cli.config.root import EvalConfig


def run(cfg: EvalConfig, run_dir: Path) -> int:
    from transformers import AutoTokenizer

    from qarl_cli.data.prompts import check_lengths, encode
    from qarl_cli.data.splits import load_splits
    from qarl_cli.train.evaluate import evaluate, pass_ks
    from qarl_cli.models.integrity import check_checkpoint
    from qarl_cli.models.resolve import model_dir
    from qarl_cli.quant import build_scheme
    from qarl_cli.rollout.base import build_engine, context_length
    from qarl_cli.stages import resolve

    from qarl_cli.machine.capabilities import require_served

    require_served(cfg)
    console = Console(markup=False, highlight=False, soft_wrap=True)
    path = model_dir(cfg.model, log=console.print)
    check_checkpoint(path)  # complete files, finite weights: a diverged run's checkpoint is not evaluated to 0 %
    tok = AutoTokenizer.from_pretrained(str(path))
    problems = load_splits(cfg.data, cfg.seed, train=False).test[:cfg.limit]
    prompts = encode(tok, cfg.data, problems)
    limit = context_length(cfg.rollout, path)
    check_lengths(prompts, problems, limit, cfg.max_new_tokens)
    scheme = build_scheme(cfg.quant, cfg.device)
    console.print(f"[qarl] eval {path} on {len(problems)} {cfg.data.name} problems, k={cfg.samples}, "
                  f"quant={cfg.quant.name}, rollout={cfg.rollout.name}")
    engine = build_engine(cfg.rollout, path, scheme, dtype=cfg.model.dtype, seed=cfg.seed,
                          max_model_len=limit, device=cfg.device)
    reward = resolve("reward", cfg.reward.name)(cfg.reward)
    try:
        with Progress(TextColumn("eval"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("eval", total=len(problems))
            result = evaluate(engine, tok, problems, prompts, reward, k=cfg.samples, temperature=cfg.temperature,
                              top_p=cfg.top_p, max_tokens=cfg.max_new_tokens, seed=cfg.seed,
                              progress=lambda n: bar.advance(task, n))
    finally:
        reward.close()
        engine.close()

    k, m = cfg.samples, result.metrics
    table = Table(title=f"qarl eval: {path.name}, quant={cfg.quant.name}, rollout={cfg.rollout.name}")
    columns = ["problems", f"avg@{k}"] + [f"pass@{j}" for j in pass_ks(k) if j > 1]
    for name in ["group", *columns]:
        table.add_column(name, justify="left" if name == "group" else "right")
    for group, g in [*result.groups.items(), ("all", m)]:
        table.add_row(group, f"{g['eval/problems']:.0f}", *[f"{100 * g['eval/' + c]:.1f}" for c in columns[1:]])
    console.print(table)
    console.print(f"[qarl] response length {m['eval/len_mean']:.1f} tokens; truncated "
                  f"{m['error_tokens/truncated_frac']:.1%}, looping {m['error_tokens/repeat_frac']:.1%}, garbled "
                  f"{m['error_tokens/garbled_frac']:.1%}; boxed {m['reward/boxed_frac']:.1%}; scoring failures "
                  f"{m['reward/timeout_count'] + m['reward/crash_count'] + m['reward/bad_gold_count']:.0f}; "
                  f"{m['eval/tokens_per_s']:.0f} tokens/s; {m['eval/seconds']:.0f} s")
    out = {"model": str(path), "data": cfg.data.name, "quant": cfg.quant.name, "rollout": cfg.rollout.name,
           "samples_per_problem": k, "temperature": cfg.temperature, "metrics": m, "groups": result.groups,
           "examples": result.samples}
    (run_dir / "eval.json").write_text(json.dumps(out, indent=2) + "\n")
    console.print(f"[qarl] results: {run_dir / 'eval.json'}")
    return 0
