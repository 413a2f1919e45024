"""Rollout acceptance figures: tokens/s of each engine and scheme that runs here, on the training step's shape
(arith prompts x samples, temperature 1, max 12 new tokens, the default warm-started tiny model); and per
weight sync its time and the |logprob gap| between engine and aligned trainer afterwards (dense unquantized,
dense int8, MoE), on fixed probe sequences; the aligned forward's cost against the unquantized forward (ratio);
on a GPU, the Triton kernels against their torch references.

    .venv/bin/python scripts/bench_rollout.py [--out bench_rollout.json] [--prompts 64] [--samples 8]
                                              [--engines vllm,torch] [--repeats 3]

Prints the tables and writes JSON. One engine lives at a time (in-process vLLM keeps global state)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _bench import arith_prompts, device, dtype_name, table, vllm_serves
from _bench import engine as _engine


def throughput(src, engines, prompts, samples, repeats) -> list[dict]:
    ids = arith_prompts(src, prompts)
    rows = []
    cases = [(e, q, k) for e in engines for q, k in (("none", None), ("int8", "fake"), ("int8", "lowbit"),
                                                     ("fp8_block", None), ("w4a16", None))
             if not (e == "vllm" and (k == "lowbit" or not vllm_serves(q)))]
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
    from qarl_cli.forward.aligned import align
    from qarl_cli.quant.checkpoint import load_meta_model, plan_for
    from qarl_cli.sync.inplace import InplaceSync

    gen = torch.Generator().manual_seed(0)
    probe = [torch.randint(3, 100, (24,), generator=gen).tolist() for _ in range(16)]
    rows = []
    for model_name, cls in (("dense", TinyModelConfig), ("moe", TinyMoEModelConfig)):
        src = ensure_tiny_model(cls(), log=print)
        for quant in ("none", "int8", "w4a16"):
            if model_name == "moe" and quant != "none":
                continue  # the MoE row measures the unquantized expert sync; quantized MoE syncs are in the tests
            scheme = build_scheme(SCHEMAS[quant](), device())
            for kind in engines:
                if kind == "vllm" and not vllm_serves(quant):
                    continue
                for mode in ("prequantized", "online"):
                    engine = _engine(kind, src, quant)
                    trainer = align(AutoModelForCausalLM.from_pretrained(
                        str(src), dtype=getattr(torch, dtype_name())).to(device()), scheme)
                    sync = InplaceSync(InplaceSyncConfig(mode=mode, verify_every=1, verify_tolerance=1.0), scheme,
                                       plan_for(load_meta_model(src), scheme), probe)
                    times, means, maxes = [], [], []
                    for r in range(rounds):
                        with torch.no_grad():
                            for p in trainer.parameters():
                                p.add_((torch.randn(p.shape, generator=gen) * 0.01).to(p.device, p.dtype))
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


def forward_cost(src, prompts, samples, repeats) -> list[dict]:
    """Seconds per training-step forward (no grad, as for pi_old) and forward + backward of the aligned forward
    against the unquantized one, on the step's shape (prompts x samples rows, 12 response tokens). Each repeat
    starts from fresh masters, so it includes the once-per-step quantization of the weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from qarl_cli.config.quant import SCHEMAS
    from qarl_cli.forward.logprobs import next_token_logprobs
    from qarl_cli.quant import build_scheme
    from qarl_cli.forward.aligned import align, refresh

    dev = device()
    gen = torch.Generator().manual_seed(0)
    rows = [p + torch.randint(3, 60, (12,), generator=gen).tolist() for p in arith_prompts(src, prompts)
            for _ in range(samples)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=dev)
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=dev)

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            if dev == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    out, base = [], None
    for quant, kernel in (("none", None), ("int8", "fake"), ("int8", "lowbit"), ("fp8_block", None),
                          ("w4a16", "fake"), ("w4a16", "lowbit")):
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype_name())).to(dev)
        if quant != "none":
            qcfg = SCHEMAS[quant]() if kernel is None else SCHEMAS[quant](kernel=kernel)
            model = align(model, build_scheme(qcfg, dev))

        def no_grad():
            refresh(model)
            with torch.no_grad():
                next_token_logprobs(model, ids, attn)

        def train_pass():
            refresh(model)
            model.zero_grad(set_to_none=True)
            next_token_logprobs(model, ids, attn).sum().backward()

        row = {"forward": "bf16 (unquantized)" if quant == "none" else f"aligned {quant}",
               "kernel": kernel or "-", "no_grad_s": round(timed(no_grad), 4), "fwd_bwd_s": round(timed(train_pass), 4)}
        base = base or row
        row["no_grad_ratio"] = round(row["no_grad_s"] / base["no_grad_s"], 2)
        row["fwd_bwd_ratio"] = round(row["fwd_bwd_s"] / base["fwd_bwd_s"], 2)
        out.append(row)
        print(row, flush=True)
    return out


def triton_vs_reference(repeats) -> list[dict]:
    """On a GPU: each Triton kernel against its torch reference: the time of each and the largest difference of
    their outputs (0 for the quantizers, which must be bit-identical; the matmul sums in another order)."""
    if device() != "cuda":
        print("triton kernels: skipped (no GPU here; the CPU tests run them under TRITON_INTERPRET=1)")
        return []
    import torch

    from qarl_cli.quant import fp8_block, int8, triton_kernels, wna16

    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    packed = wna16.quantize_weight_ref(w, 128)
    xs = x[:256]
    cases = {
        "act int8 per token": (lambda: triton_kernels.act_quant_int8(x), lambda: int8.quantize_act_ref(x)),
        "act fp8 1x128": (lambda: triton_kernels.act_quant_fp8_group(x, 128),
                          lambda: fp8_block.quantize_act_ref(x, 128)),
        "weight fp8 128x128": (lambda: triton_kernels.weight_quant_fp8_block(w, (128, 128)),
                               lambda: fp8_block.quantize_weight_ref(w, (128, 128))),
        "w4a16 matmul": (lambda: triton_kernels.wna16_matmul(xs, packed["weight_packed"], packed["weight_scale"], 128),
                         lambda: xs @ (wna16.unpack(packed["weight_packed"], 4, w.shape[-1]).float()
                                       * packed["weight_scale"].float().repeat_interleave(128, -1))
                         .to(torch.bfloat16).t()),
    }
    rows = []
    for name, (fast, ref) in cases.items():
        def t(fn):
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / repeats
        diff = max((u.float() - v.float()).abs().max().item() for u, v in zip(_flat(fast()), _flat(ref())))
        tf, tr = t(fast), t(ref)
        rows.append({"kernel": name, "triton_ms": round(1000 * tf, 3), "torch_ms": round(1000 * tr, 3),
                     "speedup": round(tr / tf, 2), "max_abs_diff": float(f"{diff:.3g}")})
        print(rows[-1], flush=True)
    return rows


def _flat(result) -> list:
    """A kernel's outputs as a list of tensors (a dict of packed tensors, a (values, scales) pair, or one)."""
    return list(result.values()) if isinstance(result, dict) else list(result) if isinstance(result, tuple) \
        else [result]


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
              "sync": sync_gaps(engines, args.rounds),
              "forward_cost": forward_cost(src, args.prompts, args.samples, args.repeats),
              "triton": triton_vs_reference(20)}
    table(f"rollout throughput: {args.prompts} prompts x {args.samples} samples, max 12 tokens", result["throughput"])
    table("weight sync: time and |logprob gap| engine vs aligned trainer after the sync", result["sync"])
    table("trainer forward cost per step: aligned against unquantized (ratio)", result["forward_cost"])
    if result["triton"]:
        table("Triton kernels against the torch reference (GPU)", result["triton"])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
