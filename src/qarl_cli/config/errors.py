"""Errors in what the user gave (a config value, a file, a path): reported in one line, without a traceback."""

from typing import Any, Optional


class UserError(Exception):
    """Base of every error that is the input's fault; the CLI prints its one-line message and exits non-zero."""


class ConfigError(UserError, ValueError):
    """A configuration value that cannot be used. The message is one line naming the key and the value."""


def require(ok: bool, key: str, value: Any, why: str) -> None:
    """Raise ConfigError("key=value: why") unless ok. `why` says what an acceptable value looks like."""
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


class Domain:
    """The values a numeric setting accepts: an interval (bounds open or closed, either side unbounded), 0 added
    where 0 has a meaning of its own (`zero`), and a note saying what the special values mean. Declared once per
    field in its schema's DOMAINS table; qarl_cli.config.domains checks every value against it."""

    def __init__(self, lo: Optional[float] = None, hi: Optional[float] = None, lo_open: bool = False,
                 hi_open: bool = False, note: str = "", zero: bool = False) -> None:
        self.lo, self.hi, self.lo_open, self.hi_open, self.note, self.zero = lo, hi, lo_open, hi_open, note, zero

    def allows(self, value: float) -> bool:
        if self.zero and value == 0:
            return True
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        below = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        return above and below

    def rule(self, integer: bool = False) -> str:
        """What an acceptable value is, as the error message says it: "must be >= 0 (0: never)"."""
        if self.lo is not None and self.hi is not None:
            if integer and not (self.lo_open or self.hi_open):
                text = f"must be in {self.lo}..{self.hi}"
            else:
                text = f"must be in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"
        elif self.lo is not None:
            text = f"must be {'>' if self.lo_open else '>='} {self.lo}"
        elif self.hi is not None:
            text = f"must be {'<' if self.hi_open else '<='} {self.hi}"
        else:
            return "any number"
        text = text.replace("must be", "must be 0 or", 1) if self.zero else text
        return f"{text} ({self.note})" if self.note else text

    @property
    def bounded(self) -> bool:
        return self.lo is not None or self.hi is not None

    def __repr__(self) -> str:
        return f"Domain({self.rule()})"


def ge(lo: float, note: str = "", zero: bool = False) -> Domain:
    """value >= lo (zero=True: or exactly 0, which `note` explains)."""
    return Domain(lo=lo, note=note, zero=zero)


def gt(lo: float, note: str = "") -> Domain:
    return Domain(lo=lo, lo_open=True, note=note)


def between(lo: float, hi: float, note: str = "", lo_open: bool = False, hi_open: bool = False) -> Domain:
    return Domain(lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, note=note)


ANY = Domain()  # every value means something (a seed, a reward, a coefficient of either sign)
