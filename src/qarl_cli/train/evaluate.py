"""Evaluation through a rollout engine: k samples per problem, scored by the reward stage. Used by `qarl eval`
and by the training loop's periodic evaluation.

avg@k is the mean accuracy over all k samples (pass@1 estimated with k samples); pass@j uses the unbiased
estimator 1 - C(k - c, j) / C(k, j) per problem with c correct of k (Chen et al., 2021), for j = 1, 2, 4, ...
up to k. Results are given overall and per group (the dataset a problem came from; its level when it has one)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from math import comb
from typing import Any, Callable, Optional, Sequence

from qarl_cli.data.base import Problem
from qarl_cli.reward.error_tokens import detect, error_token_metrics


def pass_at(k: int, correct: int, j: int) -> float:
    """Unbiased pass@j from `correct` hits among `k` samples."""
    if k - correct < j:
        return 1.0
    return 1.0 - comb(k - correct, j) / comb(k, j)


def pass_ks(k: int) -> list[int]:
    out, j = [], 1
    while j < k:
        out.append(j)
        j *= 2
    return out + [k]


@dataclass
class EvalResult:
    metrics: dict[str, float]  # overall: eval/avg@k, eval/pass@j, eval/len_mean, error tokens, reward statuses
    groups: dict[str, dict[str, float]] = field(default_factory=dict)  # per dataset / level
    samples: list[dict] = field(default_factory=list)  # first few completions, for a look


def _group_metrics(k: int, hits: Sequence[Sequence[int]]) -> dict[str, float]:
    out = {f"eval/avg@{k}": sum(map(sum, hits)) / max(len(hits) * k, 1)}
    for j in pass_ks(k):
        out[f"eval/pass@{j}"] = sum(pass_at(k, sum(h), j) for h in hits) / max(len(hits), 1)
    out["eval/problems"] = float(len(hits))
    return out


def group_of(problem: Problem) -> str:
    return f"{problem.source} level {problem.level}" if problem.level else problem.source


def evaluate(engine: Any, tokenizer: Any, problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
             reward: Any, *, k: int, temperature: float, top_p: float, max_tokens: int, seed: int,
             chunk: int = 256, keep_samples: int = 8, progress: Optional[Callable[[int], None]] = None
             ) -> EvalResult:
    """`prompts[i]`: the token ids of `problems[i]`'s prompt (data.prompts.encode). `progress(n)` is called as
    prompts finish."""
    start = time.perf_counter()
    hits: list[list[int]] = []
    flags, lengths, results, shown = [], [], [], []
    gen_seconds = tokens = 0.0
    for lo in range(0, len(problems), chunk):
        part = problems[lo:lo + chunk]
        batch = engine.generate(list(prompts[lo:lo + chunk]), n=k, temperature=temperature,
                                top_p=top_p, max_tokens=max_tokens, seed=seed + lo)
        gen_seconds += batch.seconds
        tokens += batch.num_tokens
        texts, batch_flags = decode(batch, tokenizer, max_tokens)
        flags += batch_flags
        lengths += batch.lengths
        scored = reward.score(texts, [part[i].answer for i in batch.prompt_index])
        results.append(scored)
        for i, text in enumerate(texts):
            if len(shown) < keep_samples:
                p = part[batch.prompt_index[i]]
                shown.append({"prompt": p.prompt, "answer": p.answer, "completion": text, "status":
                              scored.details[i].status})
        per_problem: dict[int, list[int]] = defaultdict(list)
        for i, d in zip(batch.prompt_index, scored.details):
            per_problem[i].append(int(d.status == "correct"))
        hits += [per_problem[i] for i in range(len(part))]
        if progress:
            progress(len(part))
    by_group: dict[str, list[list[int]]] = defaultdict(list)
    for p, h in zip(problems, hits):
        by_group[group_of(p)].append(h)
    from qarl_cli.reward.base import RewardResult

    merged = RewardResult([x for r in results for x in r.rewards], [d for r in results for d in r.details])
    metrics = {**_group_metrics(k, hits), "eval/len_mean": sum(lengths) / max(len(lengths), 1),
               **error_token_metrics(flags), **merged.metrics(),
               "eval/tokens_per_s": tokens / gen_seconds if gen_seconds else 0.0,
               "eval/seconds": time.perf_counter() - start}
    groups = {g: _group_metrics(k, h) for g, h in sorted(by_group.items())} if len(by_group) > 1 else {}
    return EvalResult(metrics, groups, shown)


def decode(batch: Any, tokenizer: Any, max_tokens: int) -> tuple[list[str], list]:
    """The responses' texts (the final stop token left out) and their error-token flags."""
    from qarl_cli.rollout.base import stop_ids

    stop = stop_ids(tokenizer.eos_token_id)
    bodies = [r[:-1] if r and reason == "stop" and r[-1] in stop else r
              for r, reason in zip(batch.response_ids, batch.finish_reasons)]
    texts = tokenizer.batch_decode(bodies, skip_special_tokens=True)
    return texts, [detect(b, t, max_tokens, f) for b, t, f in zip(bodies, texts, batch.finish_reasons)]
