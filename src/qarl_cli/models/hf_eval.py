"""Greedy decoding with a Hugging Face model and exact-match scoring: how the tiny model's build measures its
starting accuracy. (Training and `qarl eval` sample through a rollout engine and score through the reward stage.)"""

from __future__ import annotations

from collections import defaultdict

from qarl_cli.data.base import Problem
from qarl_cli.reward.boxed import last_boxed


def user_messages(problems: list[Problem]) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": p.prompt}] for p in problems]


def prompt_ids(tok, messages: list[list[dict[str, str]]]) -> list[list[int]]:
    # Render with the chat template, then tokenize the batch at once (much faster than tokenizing per call).
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    return tok(texts, add_special_tokens=False)["input_ids"]


def greedy_texts(model, tok, messages: list[list[dict[str, str]]], max_new_tokens: int = 12,
                 batch_size: int = 256) -> list[str]:
    import torch

    model.eval()
    texts: list[str] = []
    for i in range(0, len(messages), batch_size):
        batch = tok.pad({"input_ids": prompt_ids(tok, messages[i:i + batch_size])}, padding=True,
                        return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        texts += tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


def greedy_accuracy(model, tok, problems: list[Problem], max_new_tokens: int = 12) -> dict:
    """Exact-match accuracy of greedy answers, overall and per level."""
    texts = greedy_texts(model, tok, user_messages(problems), max_new_tokens)
    hits: dict[int, list[int]] = defaultdict(list)
    for p, text in zip(problems, texts):
        answer = last_boxed(text)
        hits[p.level].append(int(answer is not None and answer.strip() == p.answer))
    total = [h for v in hits.values() for h in v]
    return {"accuracy": sum(total) / max(len(total), 1),
            **{f"accuracy_level{lv}": sum(v) / len(v) for lv, v in sorted(hits.items())}}
