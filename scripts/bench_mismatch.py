"""Training-inference mismatch on the same rollouts: the trainer's unquantized forward (forward=bf16, the naive
quantized-rollout baseline) against the rollout-aligned forward (forward=aligned, QaRL), per scheme.

For each scheme the engine that serves it samples one rollout batch from the default warm-started tiny model
(arith prompts x samples, at qarl train's default temperature and response length): real vLLM where it serves the
scheme here (qarl_cli.machine.capabilities: int8, and w4a16 in its fp16/bf16), the embedded torch engine elsewhere. Both
trainer forwards then score the very same tokens (as qarl train's learner does), and mismatch/* (qarl_cli.update.mismatch,
the training metrics) compares each with the engine's logprobs. Target: aligned k3_kl at least 10x below bf16's.
Each row also gives the share of responses with error tokens; `--schemes none,w4a16` sets quantized sampling's
beside the unquantized engine's; `--schemes w4a16,nvfp4,mxfp4` the fp4 formats beside W4A16.

    .venv/bin/python scripts/bench_mismatch.py [--out bench_mismatch.json] [--prompts 64] [--samples 8]
                                               [--model tiny_arith|tiny_cot|tiny_moe|smollm2_135m] [--max-tokens N]
                                               [--model-path CHECKPOINT] [--plot log_w_vs_length.png]

--model tiny_cot measures the long-response miniature (data=arith_cot prompts, worked solutions of 40-150 tokens);
--model smollm2_135m the real model on GSM8K test prompts (default 160-token responses: long enough for the
mismatch of every position to show). Each row also gives k3_kl by response position (the `@a-b` columns), which
says whether the mismatch grows along a response (attention over a longer context, errors of earlier tokens
carried in the KV cache) or is the same at every position. --model-path measures a trained checkpoint of that
model (a run's checkpoints/step_N/model) and --plot draws each sequence's log w against its response length.
--experiment NAME takes the prompts, temperature and response length of a preset (conf/experiment/NAME.yaml: its
data option and `data:` block, its `temperature`), e.g. `--model smollm2_135m --experiment smollm2_arith`, the task
the real model is trained on. The error-token columns split the share of responses with error tokens into loops,
truncation and garble (qarl_cli.reward.error_tokens).

--model tiny_moe (warm-started on arith) adds routing replay (qarl_cli.forward.routing): the engine returns the experts it routed
each token to, and each trainer forward is measured twice, replaying them (`k3_kl`, as qarl train's learner with
rollout.routing_replay on) and with its own routing (`k3_kl no replay`), with `routing agreement` (the share of
(token, layer) pairs whose top-k set is the engine's) and its lowest layer. vLLM returns routed experts only where
it can run its Model Runner V2 (Triton); elsewhere its routing is recorded by a callback on its routers, one request
at a time (scripts/_vllm_routing.py), said in a line; schemes vLLM does not serve for MoE here take the torch engine.

Prints a markdown table and writes JSON. On the CPU "bf16" is the unquantized fp32 model (the tiny model's
dtype); on a GPU both trainer forwards run in bf16."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _bench import arith_prompts, device, dtype_name, engine, markdown, scheme_config, vllm_serves, w4a16_group

KEYS = ("k3_kl", "abs_logp_diff_mean", "abs_logp_diff_max")
POSITION_EDGES = (0, 8, 32, 64, 128, 10**9)  # response-position buckets of the per-position k3_kl


def k3_by_position(old, rollout, mask) -> dict[str, float]:
    """k3_kl = mean(r - 1 - log r) over the response tokens at positions [a, b) of their response, per bucket."""
    import torch

    from qarl_cli.update.mismatch import LOG_RATIO_CLAMP

    m = mask.bool()
    pos = m.long().cumsum(-1) - 1  # each token's index within its response
    d = (old.double() - rollout.double()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # as mismatch_metrics
    k3 = torch.expm1(d) - d
    out = {}
    for a, b in zip(POSITION_EDGES, POSITION_EDGES[1:]):
        sel = m & (pos >= a) & (pos < b)
        if sel.any():
            out[f"@{a}-{b if b < 10**9 else ''}"] = float(f"{k3[sel].mean().item():.3g}")
    return out


def trainer_logprobs(model, seqs):
    """pi_old as qarl train computes it: the learner's no-grad pass over the batch (Learner.old_logprobs)."""
    import torch

    from qarl_cli.config.root import TrainConfig
    from qarl_cli.update.objectives import sequence_ratio_loss
    from qarl_cli.update.learner import Learner

    # 16 rows per forward: a real vocabulary's fp32 logits for a whole batch (128 x 180 x 49k) fill the memory
    return Learner(model, TrainConfig(), sequence_ratio_loss, torch.device(device())).old_logprobs(seqs, chunk=16)


def preset(name: str) -> tuple[object, float | None]:
    """(data config, temperature or None) of conf/experiment/NAME.yaml: its data option with its `data:` block."""
    from omegaconf import OmegaConf

    from qarl_cli.config.data import SCHEMAS as DATA
    from qarl_cli.config.registry import conf_dir

    path = conf_dir() / "experiment" / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"bench_mismatch: --experiment {name}: no {path}")
    conf = OmegaConf.to_container(OmegaConf.load(path))
    option = next((d["override /data"] for d in conf.get("defaults", []) if isinstance(d, dict)
                   and "override /data" in d), "arith")
    return DATA[option](**conf.get("data", {})), conf.get("temperature")


def prompts_of(model: str, src, n: int, data=None) -> list[list[int]]:
    if data is not None:
        return arith_prompts(src, n, cfg=data)
    if model in ("tiny_arith", "tiny_moe"):
        return arith_prompts(src, n)
    if model == "tiny_cot":
        from qarl_cli.config.data import ArithCotDataConfig

        return arith_prompts(src, n, cfg=ArithCotDataConfig())
    from transformers import AutoTokenizer

    from qarl_cli.config.data import GSM8KDataConfig
    from qarl_cli.data.prompts import encode
    from qarl_cli.data.splits import load_splits

    data = GSM8KDataConfig()
    return encode(AutoTokenizer.from_pretrained(str(src)), data, load_splits(data, 0, train=False).test[:n])


def measure(src, spec: str, ids: list, samples: int, seed: int, max_tokens: int, temperature: float) -> dict:
    """spec: a scheme name, or int8:lowbit for the aligned forward's real int8 GEMM (torch._int_mm); none: the
    unquantized engine (its samples' error rate; the learner's gap is the engines' float difference)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qarl_cli.config.root import TrainConfig
    from qarl_cli.update.mismatch import mismatch_metrics
    from qarl_cli.quant import build_scheme
    from qarl_cli.forward.aligned import align
    from qarl_cli.update.sequences import pack

    from qarl_cli.machine.capabilities import checkpoint_is_moe

    quant, _, kernel = spec.partition(":")
    moe = checkpoint_is_moe(src)
    kind = "vllm" if vllm_serves(quant, moe) else "torch"
    if moe and kind == "torch":
        print(f"[bench] quant={quant}: vLLM does not serve it for an MoE here; rollouts from the torch engine", flush=True)
    elif moe:
        from qarl_cli.rollout.routing import routing_unavailable

        if why := routing_unavailable():
            print(f"[bench] quant={quant}: {why}: its routing is recorded by a callback on its routers instead, one "
                  "request at a time (scripts/_vllm_routing.py)", flush=True)
            kind = "vllm (router callback)"
    served = engine(kind.split()[0], src, quant, max_model_len=max(map(len, ids)) + max_tokens, **settings(quant, src))
    try:
        if kind == "vllm (router callback)":
            import _vllm_routing

            batch = _vllm_routing.generate(served, _vllm_routing.bind(served.llm), ids, samples,
                                           temperature, TrainConfig.top_p, max_tokens, seed)
        else:
            batch = served.generate(ids, samples, temperature, TrainConfig.top_p, max_tokens, seed=seed)
    finally:
        served.close()
    from qarl_cli.train.evaluate import decode
    from qarl_cli.update.mismatch import sequence_log_ratio

    tok = AutoTokenizer.from_pretrained(str(src))
    seqs = pack(ids, batch, tok.pad_token_id if tok.pad_token_id is not None else 0)
    _, flags = decode(batch, tok, max_tokens)
    per_seq = {"len": batch.lengths, "error": [f.any for f in flags]}
    dtype = getattr(torch, dtype_name())
    row = {"scheme": quant, "aligned kernel": kernel or "fake",
           "engine": kind if kind.startswith("vllm") else "torch (embedded)",
           "tokens": int(seqs.mask.sum()), "response len": round(float(seqs.mask.sum()) / len(batch), 1),
           # responses with error tokens (repeats, garble, truncation: qarl_cli.reward.error_tokens)
           "error tokens %": round(100 * sum(per_seq["error"]) / len(batch), 1),
           **{f"{kind} %": round(100 * sum(getattr(f, kind) for f in flags) / len(batch), 1)
              for kind in ("repeat", "truncated", "garbled")}}
    if quant == "none":  # the unquantized engine's samples: their error rate, and the learner's gap to them
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).to(device()).eval()
        old = trainer_logprobs(model, seqs)
        per_seq["bf16 log_w"] = sequence_log_ratio(old, seqs.rollout_logprobs, seqs.mask).tolist()
        m = mismatch_metrics(old, seqs.rollout_logprobs, seqs.mask)
        row.update({f"bf16 {k}": float(f"{m[f'mismatch/{k}']:.3g}") for k in KEYS})
        print(row, flush=True)
        return row, per_seq
    for forward in ("bf16", "aligned"):
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).to(device()).eval()
        if forward == "aligned":
            qcfg = scheme_config(quant, src, **({"kernel": kernel} if kernel else {}), **settings(quant, src))
            model = align(model, build_scheme(qcfg, device()))
        old = trainer_logprobs(model, seqs)
        per_seq[f"{forward} log_w"] = sequence_log_ratio(old, seqs.rollout_logprobs, seqs.mask).tolist()
        m = mismatch_metrics(old, seqs.rollout_logprobs, seqs.mask)
        for k in KEYS:
            row[f"{forward} {k}"] = float(f"{m[f'mismatch/{k}']:.3g}")
        for bucket, v in k3_by_position(old, seqs.rollout_logprobs, seqs.mask).items():
            row[f"{forward} k3 {bucket}"] = v
        if seqs.routed_experts is not None:  # old was replayed; the same forward with its own routing:
            row.update({f"{forward} {k}": float(f"{v:.4g}") for k, v in routing_row(model, seqs).items()})
    aligned = row["aligned k3_kl"]
    ratio = row["bf16 k3_kl"] / aligned if aligned > 0 else float("inf")
    row["k3_kl ratio"] = f"{ratio:.3g}"
    row["target met (>= 10x)"] = ratio >= 10
    print(row, flush=True)
    return row, per_seq


def settings(quant: str, src) -> dict:
    """w4a16's group size for the checkpoint; for nvfp4 / mxfp4 the activations of the engine serving them here
    (vLLM: W4A4 on Blackwell, sm_100 and up, weight-only through Marlin before it; the torch engine: W4A4)."""
    if quant == "w4a16":
        return {"group_size": w4a16_group(src)}
    if quant in ("nvfp4", "mxfp4"):
        import torch

        return {"activations": not torch.cuda.is_available() or torch.cuda.get_device_capability(0)[0] >= 10}
    return {}


def routing_row(model, seqs) -> dict[str, float]:
    """The forward with the learner's own routing: agreement with the engine's and k3_kl without replay."""
    import torch

    from qarl_cli.update.distributed import Single
    from qarl_cli.update.routing_agreement import no_replay_metrics

    m = no_replay_metrics(model, seqs, Single(), 256, torch.device(device()))
    return {"routing agreement": m["moe/routing_agreement"], "agreement min layer": m["moe/routing_agreement_min_layer"],
            "k3_kl no replay": m["mismatch/k3_kl_no_replay"]}


def scatter(per_scheme: dict[str, dict], out: Path, title: str) -> None:
    """Per sequence: log w = mean_t(log pi_old - log mu) against response length, both trainer forwards, one
    panel per scheme; sequences with error tokens (repeat, garble, truncation) drawn as crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(per_scheme), figsize=(5.5 * len(per_scheme), 4), squeeze=False)
    for ax, (scheme, d) in zip(axes[0], per_scheme.items()):
        for forward, color in (("bf16", "tab:red"), ("aligned", "tab:blue")):
            if f"{forward} log_w" not in d:  # the unquantized engine: no aligned learner
                continue
            for err, marker in ((False, "."), (True, "x")):
                pts = [(n, w) for n, w, e in zip(d["len"], d[f"{forward} log_w"], d["error"]) if e == err]
                if pts:
                    xs, ys = zip(*pts)
                    ax.scatter(xs, ys, s=8, marker=marker, color=color, alpha=0.5,
                               label=f"{forward} learner{' (error tokens)' if err else ''}")
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_title(f"{scheme} rollouts", fontsize=9)
        ax.set_xlabel("response length (tokens)")
        ax.set_ylabel("sequence log w")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_mismatch.json")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schemes", default="int8,int8:lowbit,fp8_block,w4a16",
                    help="also none, nvfp4, mxfp4 (on a CPU those take the torch engine)")
    ap.add_argument("--model", default="tiny_arith", choices=["tiny_arith", "tiny_cot", "tiny_moe", "smollm2_135m"])
    ap.add_argument("--model-path", default=None,
                    help="a checkpoint of that model (a run's checkpoints/step_N/model) instead of the built one")
    ap.add_argument("--plot", default=None, help="also draw sequence log w against response length to this PNG")
    ap.add_argument("--experiment", default=None,
                    help="take prompts, temperature and response length from conf/experiment/NAME.yaml")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="response length (default: the task's max_new_tokens for the tiny models, 160 for "
                         "smollm2_135m)")
    args = ap.parse_args()
    from qarl_cli.config.data import ArithCotDataConfig, ArithDataConfig
    from qarl_cli.config.model import SCHEMAS as MODELS
    from qarl_cli.config.root import TrainConfig
    from qarl_cli.models.resolve import model_dir

    src = Path(args.model_path) if args.model_path else model_dir(MODELS[args.model](), log=print)
    default_tokens = {"tiny_arith": ArithDataConfig.max_new_tokens, "tiny_cot": ArithCotDataConfig.max_new_tokens,
                      "tiny_moe": ArithDataConfig.max_new_tokens}
    data, temperature = preset(args.experiment) if args.experiment else (None, None)
    temperature = TrainConfig.temperature if temperature is None else temperature
    max_tokens = args.max_tokens or (data.max_new_tokens if data else default_tokens.get(args.model, 160))
    ids = prompts_of(args.model, src, args.prompts, data)
    measured = {spec: measure(src, spec, ids, args.samples, args.seed, max_tokens, temperature)
                for spec in args.schemes.split(",")}
    rows = [row for row, _ in measured.values()]
    print(f"\nmismatch on the same rollouts ({args.model}, {args.prompts} prompts x {args.samples} samples, "
          f"device {device()}): trainer forward bf16 vs aligned, against the engine's logprobs\n")
    print(markdown(rows))
    Path(args.out).write_text(json.dumps({"device": device(), "model": args.model, "model_path": args.model_path,
                                          "max_tokens": max_tokens, "prompts": args.prompts,
                                          "experiment": args.experiment, "temperature": temperature,
                                          "samples": args.samples, "rows": rows,
                                          "sequences": {k: v for k, (_, v) in measured.items()}}) + "\n")
    if args.plot:
        scatter({k: v for k, (_, v) in measured.items()}, Path(args.plot),
                f"{args.model_path or args.model}{f' ({args.experiment})' if args.experiment else ''}: "
                f"{args.prompts} prompts x {args.samples} samples, temperature {temperature}")
        print(f"wrote {args.plot}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
