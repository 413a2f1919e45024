"""Greedy decoding with a Hugging Face model and exact-match scoring: how the tiny model's build measures its
starting accuracy. (Training and `qarl eval` sample through a rollout engine and score through the reward stage.)"""

from __future__ import annotations

from collections import defaultdict

from qarl_cli.config.data import ArithDataConfig
from qarl_cli.data.base import Problem
from qarl_cli.data.prompts import prompt_ids
from qarl_cli.reward.boxed import last_boxed


def user_messages(problems: list[Problem]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p.prompt}] for p in problems]


def generate_texts(model, tok, messages: list[list[dict[str, str]]],
                   max_new_tokens: int = ArithDataConfig.max_new_tokens, batch_size: int = 256,
                   samples: int = 0) -> list[str]:
    """Greedy answers, or with samples = k > 0, k answers per prompt sampled at temperature 1 (prompt i's are
    texts[i * k:(i + 1) * k]), from torch's global generator. max_new_tokens: by default the arithmetic task's
    answer length (data=arith's max_new_tokens), what the tiny models are built and checked on."""
    import torch

    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples) if samples \
        else dict(do_sample=False)
    model.eval()
    texts: list[str] = []
    for i in range(0, len(messages), batch_size):
        batch = tok.pad({"input_ids": prompt_ids(tok, messages[i:i + batch_size])}, padding=True,
                        return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts += tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


def is_correct(problem: Problem, text: str) -> bool:
    answer = last_boxed(text)
    return answer is not None and answer.strip() == problem.answer


def sampled_accuracy(model, tok, problems: list[Problem], k: int = 4,
                     max_new_tokens: int = ArithDataConfig.max_new_tokens) -> float:
    """avg@k: exact-match accuracy of k answers per problem sampled at temperature 1."""
    texts = generate_texts(model, tok, user_messages(problems), max_new_tokens, samples=k)
    return sum(is_correct(problems[i // k], text) for i, text in enumerate(texts)) / len(texts)


def greedy_accuracy(model, tok, problems: list[Problem],
                    max_new_tokens: int = ArithDataConfig.max_new_tokens) -> dict:
    """Exact-match accuracy of greedy answers, overall and per level."""
    texts = generate_texts(model, tok, user_messages(problems), max_new_tokens)
    hits: dict[int, list[int]] = defaultdict(list)
    for p, text in zip(problems, texts):
        hits[p.level].append(int(is_correct(p, text)))
    total = [h for v in hits.values() for h in v]
    return {"accuracy": sum(total) / max(len(total), 1),
            **{f"accuracy_level{lv}": sum(v) / len(v) for lv, v in sorted(hits.items())}}
