"""From problems to the token ids an engine is given: the prompt template (an optional system message, the
problem, the data option's instruction) rendered with the tokenizer's chat template. Every caller (training
steps, evaluation, the sync probe, `qarl eval`) goes through `encode`, so a prompt is the same everywhere."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from qarl_cli.config.errors import UserError
from qarl_cli.data.base import Problem


class PromptTooLong(UserError, ValueError):
    """A prompt that cannot fit the engine's context together with the response length."""


def chat_messages(cfg: Any, problem: Problem) -> list[dict[str, str]]:
    """The prompt template of the data config `cfg` (its system_prompt and instruction) for one problem."""
    user = f"{problem.prompt}\n\n{cfg.instruction}" if cfg.instruction else problem.prompt
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    return [*system, {"role": "user", "content": user}]


def prompt_ids(tok: Any, messages: Sequence[list[dict[str, str]]],
               template_kwargs: Optional[Mapping[str, Any]] = None) -> list[list[int]]:
    """Chat prompts rendered with the chat template (generation prompt added; `template_kwargs` are the template's
    own variables, such as Qwen3's enable_thinking), tokenized as one batch (much faster than one call per
    prompt)."""
    extra = dict(template_kwargs or {})
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **extra) for m in messages]
    return tok(texts, add_special_tokens=False)["input_ids"] if texts else []


def encode(tok: Any, cfg: Any, problems: Sequence[Problem]) -> list[list[int]]:
    """Token ids of each problem's prompt under the data config `cfg`."""
    return prompt_ids(tok, [chat_messages(cfg, p) for p in problems], getattr(cfg, "chat_template_kwargs", None))


def check_lengths(prompts: Sequence[Sequence[int]], problems: Sequence[Problem], limit: int, max_new_tokens: int,
                  what: str = "data") -> None:
    """Every prompt leaves room for max_new_tokens within the engine's context `limit`, or a one-line error naming
    the first prompt that does not (its file and line where it came from a file)."""
    room = limit - max_new_tokens
    if room <= 0:
        raise PromptTooLong(f"max_new_tokens={max_new_tokens} does not fit the engine's context of {limit} tokens "
                            "with any prompt: lower it, or raise rollout.max_model_len where the model allows")
    for ids, p in zip(prompts, problems):
        if len(ids) > room:
            where = getattr(p, "origin", "") or f"{what} problem {p.prompt[:40]!r}"
            raise PromptTooLong(f"{where}: the prompt is {len(ids)} tokens; with max_new_tokens={max_new_tokens} "
                                f"the engine's context of {limit} tokens leaves room for {max(room, 0)} (shorten "
                                "it, lower max_new_tokens, or raise rollout.max_model_len where the model allows)")
