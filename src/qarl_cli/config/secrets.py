"""Secrets a run is given (the servers' key, `rollout.api_key`) never reach what it writes or shows: the run
directory's `.hydra/` record and a sweep's `multirun.yaml`, the config saved with each checkpoint, the config
handed to the loggers (wandb's included). What is recorded is that a key was set (REDACTED), not the key; the
servers get it from their environment, never on a command line. A resume compares the record, not the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

SECRET_FIELDS = ("api_key",)
REDACTED = "<set>"


def redact(data: Any) -> Any:
    """`data` (a config as plain dicts and lists) with every set secret field replaced by REDACTED."""
    if isinstance(data, dict):
        return {k: (REDACTED if k in SECRET_FIELDS and v not in (None, "") else redact(v)) for k, v in data.items()}
    if isinstance(data, list):
        return [redact(v) for v in data]
    return data


def values(cfg: Any) -> list[str]:
    """The secret values set in a validated config (its rollout's key, where it has one)."""
    found = [getattr(getattr(cfg, "rollout", None), name, None) for name in SECRET_FIELDS]
    return [v for v in found if isinstance(v, str) and v]


def scrub(text: str, secrets: list[str]) -> str:
    """`text` with every occurrence of each secret replaced by REDACTED."""
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def scrub_files(files: Iterable[Path], secrets: list[str]) -> None:
    """Replace every occurrence of each secret in `files` (those that exist) by REDACTED, in place."""
    for file in files:
        file = Path(file)
        if not secrets or not file.is_file():
            continue
        text = file.read_text()
        if scrub(text, secrets) != text:
            file.write_text(scrub(text, secrets))
