"""Errors in what the user gave (a config value, a file, a path): reported in one line, without a traceback."""

from typing import Any


class UserError(Exception):
    """Base of every error that is the input's fault; the CLI prints its one-line message and exits non-zero."""


class ConfigError(UserError, ValueError):
    """A configuration value that cannot be used. The message is one line naming the key and the value."""


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise ConfigError("key=value: why") unless ok. `why` says what an acceptable value looks like."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")
