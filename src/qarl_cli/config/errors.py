"""The one error type a bad configuration raises, and a helper for validators."""

from typing import Any


class ConfigError(ValueError):
    """A configuration value that cannot be used. The message is one line naming the key and the value."""


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise ConfigError("key=value: why") unless ok. `why` says what an acceptable value looks like."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")
