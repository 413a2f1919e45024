"""Error tokens: the failure mode of quantized rollouts, detected per response.

Low-bit rollouts drift into degenerate tails: a phrase repeated until the length limit, or garbled output
(undecodable bytes, control characters). The paper traces the late-training entropy rise of quantized rollouts
to such tokens; these flags and metrics make them visible per step. Pure functions, no model needed."""

import unicodedata
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

MAX_BLOCK = 16  # longest repeated block, in tokens, that counts as a loop (docs/design.md)
MIN_REPEATS = 4  # a block must occur this many times in a row at the end

# Character categories no sound response contains: controls (tab and newlines aside), lone surrogates,
# private use, unassigned. Not str.isprintable(), which also rejects no-break and thin spaces (Zs) and
# zero-width joiners (Cf), all legitimate in LaTeX-flavoured or emoji text.
_BAD_CATEGORIES = frozenset({"Cc", "Cs", "Co", "Cn"})
_ALLOWED_CONTROLS = frozenset("\t\n\r")
_REPLACEMENT = "\ufffd"  # what a tokenizer decodes a byte sequence that is not UTF-8 into


@dataclass(frozen=True)
class ErrorFlags:
    repeat: bool  # the response ends in a loop: a block of <= MAX_BLOCK tokens repeated >= MIN_REPEATS times
    truncated: bool  # generation stopped at the length limit
    garbled: bool  # the text holds a replacement character or a non-printable character
    repeated_tokens: int  # tokens of the final loop after its first block (the redundant copies); 0 if no loop
    num_tokens: int

    @property
    def any(self) -> bool:
        return self.repeat or self.truncated or self.garbled


def tail_loop(token_ids: Sequence[int], max_block: int = MAX_BLOCK, min_repeats: int = MIN_REPEATS) -> tuple[int, int]:
    """(block length, span) of the loop the sequence ends in, or (0, 0) if none repeats min_repeats times.

    The span is the length of the periodic tail, which may begin and end mid-block (a loop cut by the length
    limit); the block repeats span // block times. The longest span wins, then the shortest block."""
    ids = np.asarray(token_ids, dtype=np.int64)
    n = len(ids)
    best = (0, 0)
    for block in range(1, min(max_block, n // min_repeats) + 1):
        # The tail is periodic with this block length as far back as ids[i] == ids[i - block] holds.
        same = ids[block:] == ids[:-block]
        breaks = np.flatnonzero(~same)
        run = len(same) - (int(breaks[-1]) + 1 if len(breaks) else 0)
        span = run + block
        if span // block >= min_repeats and span > best[1]:
            best = (block, span)
    return best


def is_garbled(text: str) -> bool:
    """Whether text contains U+FFFD or a character of a category no response should contain."""
    if _REPLACEMENT in text:
        return True
    if text.isprintable():  # fast path, in C, for the common clean ASCII text
        return False
    return any(unicodedata.category(ch) in _BAD_CATEGORIES and ch not in _ALLOWED_CONTROLS for ch in text)


def detect(token_ids: Sequence[int], text: str, max_tokens: int, finish_reason: Optional[str] = None) -> ErrorFlags:
    """Flags of one response. `token_ids` are the generated tokens less a final stop token, so that a loop the
    model closes with EOS still counts; `text` is their decoding. Truncation is finish_reason == "length" when
    the engine reports one (vLLM, transformers wrappers), otherwise len(token_ids) >= max_tokens."""
    block, span = tail_loop(token_ids)
    if finish_reason is not None:
        truncated = finish_reason == "length"
    else:
        truncated = len(token_ids) >= max_tokens
    return ErrorFlags(repeat=block > 0, truncated=truncated, garbled=is_garbled(text),
                      repeated_tokens=span - block, num_tokens=len(token_ids))


def error_token_metrics(flags: Sequence[ErrorFlags]) -> dict[str, float]:
    """Fractions of responses that loop, are truncated, are garbled, or any of these; and the fraction of all
    response tokens that are redundant loop copies."""
    n = max(len(flags), 1)
    tokens = max(sum(f.num_tokens for f in flags), 1)
    return {
        "error_tokens/repeat_frac": sum(f.repeat for f in flags) / n,
        "error_tokens/truncated_frac": sum(f.truncated for f in flags) / n,
        "error_tokens/garbled_frac": sum(f.garbled for f in flags) / n,
        "error_tokens/any_frac": sum(f.any for f in flags) / n,
        "error_tokens/repeated_token_frac": sum(f.repeated_tokens for f in flags) / tokens,
    }
