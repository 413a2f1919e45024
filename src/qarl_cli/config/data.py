"""Schema of the `data` group: where problems come from and how they become prompts."""

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from qarl_cli.config.errors import require

BOX_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass
class DataConfig:
    name: str = MISSING  # option name
    # Local jsonl or parquet file of training problems (nothing is downloaded at run time).
    path: Optional[str] = None
    # Held-out problems for evaluation; null holds out `test_size` problems of `path` instead.
    test_path: Optional[str] = None
    test_size: int = 500
    # File layout: auto (detected from the first record) or a named one (gsm8k, math, aime, dapo, openr1).
    layout: str = "auto"
    # Prompt template: an optional system message, and an instruction appended to every problem.
    system_prompt: Optional[str] = None
    instruction: str = BOX_INSTRUCTION

    def __post_init__(self) -> None:
        require(self.test_size >= 0, "test_size", self.test_size, "must be >= 0")


@dataclass
class FileDataConfig(DataConfig):
    name: str = "file"
    path: Optional[str] = MISSING  # required

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.path), "path", self.path, f"data={self.name} needs data.path=FILE (jsonl or parquet)")


@dataclass
class ArithDataConfig(DataConfig):
    """Procedurally generated arithmetic (the embedded default). Train and test are disjoint."""

    name: str = "arith"
    levels: List[int] = field(default_factory=lambda: [1, 2, 3])  # 1: 2-digit +/-, 2: 2-3 digit * digit, 3: two-step
    test_size: int = 500  # the test split is fixed (see qarl_cli.data.arith); the run's seed orders training
    instruction: str = ""  # the tiny model learned the format in its warm start; no instruction needed

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.levels) > 0 and all(lv in (1, 2, 3) for lv in self.levels), "levels", self.levels,
                "must be a non-empty list drawn from 1, 2, 3")


# The common public layouts; data.path is still required (nothing is downloaded).
@dataclass
class GSM8KDataConfig(FileDataConfig):
    name: str = "gsm8k"
    layout: str = "gsm8k"


@dataclass
class Math500DataConfig(FileDataConfig):
    name: str = "math500"
    layout: str = "math"


@dataclass
class AIMEDataConfig(FileDataConfig):
    name: str = "aime"
    layout: str = "aime"


@dataclass
class DAPOMathDataConfig(FileDataConfig):
    name: str = "dapo_math"
    layout: str = "dapo"


@dataclass
class OpenR1MathDataConfig(FileDataConfig):
    name: str = "openr1_math"
    layout: str = "openr1"


SCHEMAS = {
    "arith": ArithDataConfig,
    "file": FileDataConfig,
    "gsm8k": GSM8KDataConfig,
    "math500": Math500DataConfig,
    "aime": AIMEDataConfig,
    "dapo_math": DAPOMathDataConfig,
    "openr1_math": OpenR1MathDataConfig,
}
