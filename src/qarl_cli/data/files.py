"""Problems from local jsonl and parquet files in the layouts of the common public math datasets.

    gsm8k   question, answer ending in "#### N"                        gold: N, commas removed
    math    problem, answer or solution with \\boxed{} (MATH, MATH-500) gold: answer, else the last box of solution
    aime    problem, answer                                              gold: answer
    dapo    prompt (chat messages or text), reward_model.ground_truth    (DAPO-Math-17k and other verl-style files)
    openr1  problem / prompt / messages, answer                          (OpenR1-Math)

dapo and openr1 read the same fields, in the same order of preference (prompt: `prompt`, `problem`, `messages`;
gold: `reward_model.ground_truth`, `answer`); they differ in how they are detected. A chat-message prompt
contributes its last user message. Field names are matched case-insensitively (some AIME files say "Problem").
A malformed file raises DataError naming the file, the 1-based line (jsonl) or row (parquet), and the field."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

from qarl_cli.config.errors import UserError
from qarl_cli.data.base import Problem
from qarl_cli.reward.boxed import last_boxed

LAYOUTS = ("gsm8k", "math", "aime", "dapo", "openr1")
# Columns that OpenR1-Math has and the other layouts lack.
_OPENR1_MARKERS = {"uuid", "problem_type", "question_type", "correctness_math_verify"}
_MATH_MARKERS = {"level", "type", "subject", "unique_id"}
# Every column a layout or its detection reads: parquet files are read with these only, which leaves out bulky
# ones such as OpenR1's `generations` (several full reasoning traces per problem).
_COLUMNS = {"question", "answer", "problem", "solution", "prompt", "messages", "reward_model"} | _OPENR1_MARKERS \
    | _MATH_MARKERS


class DataError(UserError, ValueError):
    """A data file that cannot be read as problems. The message is one line: file, line or row, field."""


class _FieldError(Exception):
    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"field {field!r}: {why}")


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of range(n), fixed by (seed, epoch): the same in every process and run, different per epoch,
    so a resumed run visits the problems in the same order. (A string seed is hashed with SHA-512 by `random`,
    independent of PYTHONHASHSEED.)"""
    order = list(range(n))
    random.Random(f"qarl-epoch/{seed}/{epoch}").shuffle(order)
    return order


def detect_layout(record: dict[str, Any]) -> str:
    """The layout a record (one line or row, field names lower-cased) is in; DataError if none fits."""
    keys = set(record)
    if "reward_model" in keys:
        return "dapo"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if "problem" in keys:
        if keys & _OPENR1_MARKERS:
            return "openr1"
        if keys & _MATH_MARKERS or "answer" not in keys:
            return "math"
        return "aime"
    if keys & {"prompt", "messages"} and "answer" in keys:
        return "openr1"
    raise DataError(f"no known layout has the fields {sorted(keys)}; expected one of: question+answer (gsm8k), "
                    "problem+solution/answer (math, aime, openr1), prompt+reward_model (dapo)")


def load_problems(path: str, layout: str = "auto", source: str = "", skipped: list[str] | None = None
                  ) -> list[Problem]:
    """All problems of a .jsonl (.ndjson) or .parquet file. `layout` is "auto" (detected from the first record)
    or one of LAYOUTS; `source` names the problems for per-source metrics (default: the file's stem). `skipped`:
    a list to collect ("line N: why") the records whose fields give no problem, which are then left out instead
    of failing the file (the packaged datasets: data/packaged.py)."""
    if layout != "auto" and layout not in LAYOUTS:
        raise DataError(f"{path}: layout {layout!r} is unknown; expected auto or one of {', '.join(LAYOUTS)}")
    if not Path(path).is_file():
        raise DataError(f"{path}: no such file")
    source = source or Path(path).stem
    problems = []
    name = None if layout == "auto" else layout
    for where, raw in _records(path):
        record = {str(k).lower(): v for k, v in raw.items()}
        try:
            name = name or detect_layout(record)
            prompt, answer, level = _EXTRACT[name](record)
        except (_FieldError, DataError) as e:
            if skipped is not None and isinstance(e, _FieldError):
                skipped.append(f"{where}: {e}")
                continue
            raise DataError(f"{path}, {where}: {e}" + (f" (layout {name})" if name else "")) from None
        problems.append(Problem(prompt=prompt, answer=answer, source=source, level=level,
                                origin=f"{path}, {where}"))
    if not problems:
        raise DataError(f"{path}: no records")
    return problems


def _records(path: str) -> Iterator[tuple[str, dict]]:
    """(position, record) pairs: "line N" for jsonl, "row N" for parquet, both counted from 1."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        with open(path, "rb") as f:  # decoded line by line, so that a bad byte is reported with its line
            for i, raw in enumerate(f, start=1):
                line = _decode(raw, path, i)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}, line {i}: invalid JSON: {e.msg} (column {e.colno})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}, line {i}: expected a JSON object, got {type(record).__name__}")
                yield f"line {i}", record
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
            table = pq.read_table(path, columns=[c for c in names if c.lower() in _COLUMNS])
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataError(f"{path}: not a readable parquet file: {e}".replace("\n", " ")) from None
        if not any(c.lower() in _COLUMNS for c in names):  # only known columns are read: say what the file has
            raise DataError(f"{path}: no known layout has the columns {names}; expected one of: question+answer "
                            "(gsm8k), problem+solution/answer (math, aime, openr1), prompt+reward_model (dapo)")
        for i, record in enumerate(table.to_pylist(), start=1):
            yield f"row {i}", record
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected .jsonl, .ndjson or .parquet")


def _decode(raw: bytes, path: str, i: int) -> str:
    """Line `i` of a jsonl file as text (UTF-8; a byte-order mark at the start of the file is skipped)."""
    if i == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        column = len(raw[:e.start].decode("utf-8")) + 1  # in characters, as json reports its columns
        raise DataError(f"{path}, line {i}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}); "
                        "jsonl files must be UTF-8: convert it (e.g. iconv -f latin1 -t utf-8)") from None


# ------------------------------------------------------------------------------------------------ fields


def _text(value: Any, field: str) -> str:
    if value is None:
        raise _FieldError(field, "missing")
    if not isinstance(value, str):
        raise _FieldError(field, f"expected text, got {type(value).__name__}")
    if not value.strip():
        raise _FieldError(field, "empty")
    return value


def _scalar(value: Any, field: str) -> str:
    """A gold answer given as text or a number, as stripped text (5.0 -> "5")."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(int(value)) if float(value).is_integer() else str(value)
    return _text(value, field).strip()


def _chat_prompt(value: Any, field: str) -> str:
    """A prompt given as text, or as chat messages whose last user message is the prompt."""
    if not isinstance(value, list):
        return _text(value, field)
    users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str) or not users[-1].strip():
        raise _FieldError(field, "no user message with text content")
    return users[-1]


def _level(value: Any) -> int:
    """MATH gives "Level 3"; some copies give 3. Anything else (e.g. "Level ?") is 0."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    digits = str(value).removeprefix("Level").strip()
    return int(digits) if digits.isdigit() else 0


# ---------------------------------------------------------------------------------------------- layouts


def _gsm8k(r: dict) -> tuple[str, str, int]:
    question = _text(r.get("question"), "question")
    solution = _text(r.get("answer"), "answer")
    if "####" not in solution:
        raise _FieldError("answer", "no '#### <final answer>' in it")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise _FieldError("answer", "nothing after '####'")
    return question, final, 0


def _math(r: dict) -> tuple[str, str, int]:
    prompt = _text(r.get("problem"), "problem")
    if r.get("answer") not in (None, ""):
        return prompt, _scalar(r["answer"], "answer"), _level(r.get("level"))
    if r.get("solution") is None:
        raise _FieldError("answer", "missing, and no 'solution' to take the \\boxed{} answer from")
    solution = _text(r["solution"], "solution")
    boxed = last_boxed(solution) or _bare_boxed(solution)
    if not boxed or not boxed.strip():
        raise _FieldError("solution", "no \\boxed{...} answer in it")
    return prompt, boxed.strip(), _level(r.get("level"))


def _bare_boxed(text: str) -> str | None:
    """`\\boxed 2`: without braces LaTeX boxes the next character (two solutions of MATH's train split say so)."""
    at = text.rfind("\\boxed ")
    rest = text[at + len("\\boxed "):].lstrip() if at >= 0 else ""
    return rest[0] if rest and rest[0] not in "{}$\\" else None


def _aime(r: dict) -> tuple[str, str, int]:
    return _text(r.get("problem"), "problem"), _scalar(r.get("answer"), "answer"), 0


def _chat(r: dict) -> tuple[str, str, int]:
    field = next((f for f in ("prompt", "problem", "messages") if r.get(f) is not None), "prompt")
    prompt = _chat_prompt(r.get(field), field)
    reward_model = r.get("reward_model")
    if reward_model is not None:
        if not isinstance(reward_model, dict):
            raise _FieldError("reward_model", f"expected an object, got {type(reward_model).__name__}")
        return prompt, _scalar(reward_model.get("ground_truth"), "reward_model.ground_truth"), 0
    if r.get("answer") is None:
        raise _FieldError("reward_model.ground_truth", "missing, and no 'answer' either")
    return prompt, _scalar(r["answer"], "answer"), 0


_EXTRACT: dict[str, Callable[[dict], tuple[str, str, int]]] = {
    "gsm8k": _gsm8k, "math": _math, "aime": _aime, "dapo": _chat, "openr1": _chat}
