"""What every data source yields: a prompt and its gold answer."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One math problem. `prompt` is the user turn (no chat template applied); `answer` is the gold
    final answer as a string (for example "42", "\\frac{1}{2}"), compared by the reward stage."""

    prompt: str
    answer: str
    source: str = ""  # dataset or generator name, for per-source metrics
    level: int = 0  # difficulty level where the source has one (arith: 1..3), else 0
