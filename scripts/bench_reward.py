"""Throughput of the math_verify scorer on a mixed batch, adversarial completions included.

    .venv/bin/python scripts/bench_reward.py [--n 1024] [--workers 2] [--out bench_reward.json]

The batch (seeded) mixes reasoning-like completions with boxed integers, fractions, percentages and polynomials
(right and wrong), plain-text answers, answerless ones, and four adversarial kinds: 10k characters of garbage,
3,000 nested parentheses, a 5,000-term sum and a power tower 9^{9^{9}}. Pool start-up is timed apart from the
batch; a second batch (another seed) without the adversarial kinds gives the everyday rate. Prints markdown tables
and writes the numbers as JSON."""

import argparse
import json
import random
import statistics
import time
from collections import Counter

from qarl_cli.config.reward import MathVerifyRewardConfig
from qarl_cli.reward.base import STATUSES
from qarl_cli.reward.math_verify import MathVerifyReward

# kind -> share of the batch (adversarial kinds: 8 each in 1,024)
MIX = {"int_correct": 300, "int_wrong": 200, "plain_text": 100, "no_answer": 64, "fraction": 120,
       "fraction_wrong": 60, "percent": 60, "polynomial": 88,
       "garbage_10k": 8, "nested_3000": 8, "sum_5000": 8, "tower_9^9^9": 8}
ADVERSARIAL = ("garbage_10k", "nested_3000", "sum_5000", "tower_9^9^9")


def _reasoning(rng: random.Random) -> str:
    steps = [f"Multiplying {rng.randint(2, 99)} by {rng.randint(2, 99)} gives an intermediate value. "
             f"Then we add ${rng.randint(1, 9)}$ to both sides and simplify. " for _ in range(rng.randint(3, 20))]
    return "".join(steps)


def _sample(kind: str, rng: random.Random) -> tuple[str, str]:
    """(completion, gold) of one kind."""
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    p, q = rng.randint(1, 30), rng.randint(31, 60)
    text = _reasoning(rng)
    if kind == "int_correct":
        return f"{text}So the answer is \\boxed{{{a * b}}}.", str(a * b)
    if kind == "int_wrong":
        return f"{text}So the answer is \\boxed{{{a * b + 1}}}.", str(a * b)
    if kind == "plain_text":
        return f"{text}The answer is {a + b}.", str(a + b)
    if kind == "no_answer":
        return "I am not sure how to proceed with this problem, so let me think again about the", str(a)
    if kind == "fraction":
        return f"{text}Hence \\boxed{{\\dfrac{{{2 * p}}}{{{2 * q}}}}}.", f"\\frac{{{p}}}{{{q}}}"
    if kind == "fraction_wrong":
        return f"{text}Hence \\boxed{{\\frac{{{p + 1}}}{{{q}}}}}.", f"\\frac{{{p}}}{{{q}}}"
    if kind == "percent":
        return f"{text}The probability is \\boxed{{{p / 100}}}.", f"{p}\\%"
    if kind == "polynomial":
        return f"{text}It factors as \\boxed{{(x+{p})^2}}.", f"x^2+{2 * p}x+{p * p}"
    if kind == "garbage_10k":
        return "".join(rng.choice("abcxyz{}\\^_()[]$0123456789+-*/ =.,") for _ in range(10_000)), str(a)
    if kind == "nested_3000":
        return "\\boxed{" + "(" * 3000 + "3" + ")" * 3000 + "}", "3"
    if kind == "sum_5000":
        return "\\boxed{" + "+".join(["1"] * 5000) + "}", "5000"
    if kind == "tower_9^9^9":
        return "\\boxed{9^{9^{9}}}", "3"
    raise ValueError(kind)


def make_batch(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """n (kind, completion, gold) triples in the proportions of MIX, shuffled."""
    rng = random.Random(seed)
    total = sum(MIX.values())
    kinds = [k for k, share in MIX.items() for _ in range(max(1, round(share * n / total)))][:n]
    rng.shuffle(kinds)
    return [(k, *_sample(k, rng)) for k in kinds]


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(scorer: MathVerifyReward, batch: list[tuple[str, str, str]]) -> dict:
    """Wall time, throughput, per-sample times and statuses of scoring one batch, overall and per kind."""
    t = time.perf_counter()
    res = scorer.score([c for _, c, _ in batch], [g for _, _, g in batch])
    wall = time.perf_counter() - t
    secs = [d.seconds for d in res.details]
    slowest = max(range(len(batch)), key=lambda i: secs[i])
    by_kind = {}
    for kind in [k for k in MIX if k in {b[0] for b in batch}]:
        idx = [i for i, (k, _, _) in enumerate(batch) if k == kind]
        by_kind[kind] = {"n": len(idx), "statuses": dict(Counter(res.details[i].status for i in idx)),
                         "mean_s": statistics.fmean(secs[i] for i in idx), "max_s": max(secs[i] for i in idx)}
    counts = Counter(d.status for d in res.details)
    return {
        "n": len(batch), "wall_s": wall, "completions_per_s": len(batch) / wall,
        "sample_s": {"mean": statistics.fmean(secs), "p50": _p(secs, 0.5), "p99": _p(secs, 0.99), "max": max(secs)},
        "slowest": {"kind": batch[slowest][0], "seconds": secs[slowest], "status": res.details[slowest].status},
        "statuses": {s: counts.get(s, 0) for s in STATUSES}, "by_kind": by_kind,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=None, help="default: the config's num_workers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_reward.json")
    args = ap.parse_args()

    cfg = MathVerifyRewardConfig(num_workers=args.workers) if args.workers else MathVerifyRewardConfig()
    batch = make_batch(args.n, args.seed)
    t0 = time.perf_counter()
    with MathVerifyReward(cfg) as scorer:
        scorer.score(["\\boxed{1}"], ["1"])  # waits until every worker is up
        startup = time.perf_counter() - t0
        # The second batch is drawn anew: re-scoring the same answers would hit the parsers' caches.
        clean = [b for b in make_batch(args.n, args.seed + 1) if b[0] not in ADVERSARIAL]
        runs = {"mixed": measure(scorer, batch), "no_adversarial": measure(scorer, clean)}

    print("| batch | n | wall s | completions/s | mean s | p50 s | p99 s | max s | slowest |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        t = r["sample_s"]
        print(f"| {name} | {r['n']} | {r['wall_s']:.2f} | {r['completions_per_s']:.1f} | {t['mean']:.4f} | "
              f"{t['p50']:.4f} | {t['p99']:.3f} | {t['max']:.3f} | {r['slowest']['kind']} ({r['slowest']['status']}) |")
    print(f"\n{cfg.num_workers} workers, timeout_s {cfg.timeout_s}, kill_grace_s {cfg.kill_grace_s}, "
          f"pool start-up {startup:.2f} s\n")
    mixed = runs["mixed"]
    print("| status | " + " | ".join(STATUSES) + " |\n|---|" + "---|" * len(STATUSES))
    print("| mixed | " + " | ".join(str(mixed["statuses"][s]) for s in STATUSES) + " |\n")
    print("| kind | n | mean s | max s | statuses |\n|---|---|---|---|---|")
    for kind, row in mixed["by_kind"].items():
        sts = ", ".join(f"{s} {c}" for s, c in sorted(row["statuses"].items()))
        print(f"| {kind} | {row['n']} | {row['mean_s']:.4f} | {row['max_s']:.3f} | {sts} |")
    out = {"num_workers": cfg.num_workers, "timeout_s": cfg.timeout_s, "kill_grace_s": cfg.kill_grace_s,
           "startup_s": startup, **runs}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
