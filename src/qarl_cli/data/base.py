"""What every data source yields: a prompt and its gold answer."""

from dataclasses import dataclass, field
from typing import Iterator, Protocol


@dataclass(frozen=True)
class Problem:
    """One math problem. `prompt` is the user turn (no chat template applied); `answer` is the gold
    final answer as a string (for example "42", "\\frac{1}{2}"), compared by the reward stage."""

    prompt: str
    answer: str
    source: str = ""  # dataset or generator name, for per-source metrics
    level: int = 0  # difficulty level where the source has one (arith: 1..3), else 0
    # Where it was read: "FILE, line N" (jsonl) or "FILE, row N" (parquet), as DataError names a record; "" for
    # generated problems. Provenance only: two problems that differ only in it are equal.
    origin: str = field(default="", compare=False)


class DataSource(Protocol):
    """The data stage's contract (`data` group): a fixed held-out test split and an endless, deterministic
    training stream. Built by the option's implementation as impl(cfg, seed). A source with a finite training
    set (a file) also has it as `train`, so that its prompts are checked whole when the run starts."""

    test: list[Problem]

    def train_stream(self, start: int = 0) -> Iterator[Problem]:
        """Training problems from position `start` on; the same (seed, position) gives the same problem, so a
        resumed run continues exactly."""
        ...
