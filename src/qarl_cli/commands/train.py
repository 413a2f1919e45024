"""`qarl train`. The stages of DESIGN.md run here as far as they are implemented; the rest are listed as missing.

Today: the model (built on first use for the tiny ones), the data splits, a greedy pass over the test split
(Hugging Face generate, standing in for the rollout engine) scored by the reward stage. The RL loop proper
(rollout engine, aligned forward, update, sync) needs the stages that are not implemented yet."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from qarl_cli.config.root import TrainConfig
from qarl_cli.data.splits import chat_messages, load_splits
from qarl_cli.models.resolve import model_dir
from qarl_cli.stages import is_implemented, resolve

STAGE_GROUPS = ("quant", "rollout", "reward", "forward", "algorithm", "sync")


def run(cfg: TrainConfig, run_dir: Path) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qarl_cli.models.hf_eval import greedy_texts

    console = Console(markup=False, highlight=False)  # "[qarl]" is text, not a style tag
    torch.manual_seed(cfg.seed)
    start = time.time()
    path = model_dir(cfg.model, log=console.print)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, cfg.model.dtype))
    splits = load_splits(cfg.data, cfg.seed)
    console.print(f"[qarl] model {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters); "
                  f"data={cfg.data.name}: {len(splits.test)} test problems")

    texts = greedy_texts(model, tok, [chat_messages(cfg.data, p) for p in splits.test], cfg.max_new_tokens)
    reward = resolve("reward", cfg.reward.name)(cfg.reward)
    try:
        result = reward.score(texts, [p.answer for p in splits.test])
    finally:
        reward.close()
    metrics = {"eval/greedy_acc": result.metrics()["reward/acc"], **result.metrics()}

    table = Table(title="qarl train: stages")
    table.add_column("stage")
    table.add_column("option")
    table.add_column("status")
    table.add_row("model", cfg.model.name, f"loaded {path.name}")
    table.add_row("data", cfg.data.name, f"{len(splits.test)} test problems")
    for group in STAGE_GROUPS:
        name = getattr(cfg, group).name
        ran = {"reward": f"scored {len(texts)} greedy answers"}.get(group, "available")
        table.add_row(group, name, ran if is_implemented(group, name) else "not implemented yet")
    console.print(table)
    console.print(f"[qarl] starting greedy accuracy on the test split: {metrics['eval/greedy_acc']:.1%}; "
                  f"the RL loop needs every stage above; {time.time() - start:.0f} s")
    (run_dir / "summary.json").write_text(json.dumps({"model": str(path), **metrics}, indent=2))
    return 0
