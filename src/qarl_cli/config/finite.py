"""No NaN or infinity in any config value: one generic check over the validated config (the schemas' own
comparisons let inf through, `lr > 0` for one). It walks every dataclass, mapping and list, so a float in any
schema, option, experiment preset or list (e.g. `betas`) is covered, including fields added later.

A schema where +inf is a meaningful value ("no limit") says so for those fields only:

    allow_inf: ClassVar[tuple[str, ...]] = ("eps_high", "mismatch_cap")

NaN is never accepted."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, TypeVar

from qarl_cli.config.errors import ConfigError

T = TypeVar("T")


def reject_nonfinite(cfg: T) -> T:
    """`cfg` unchanged, or ConfigError "key=value: must be a finite number" for its first NaN or infinite value
    (key dotted from the root: `lr`, `algorithm.eps_low`, `betas[1]`). `cfg`: the validated dataclasses (or
    mappings and lists of them)."""
    found = first_nonfinite(cfg)
    if found is not None:
        key, value = found
        raise ConfigError(f"{key}={value!r}: must be a finite number (not nan or inf)")
    return cfg


def first_nonfinite(tree: Any, prefix: str = "") -> Optional[tuple[str, float]]:
    """(dotted key, value) of the first non-finite float in a nested structure, or None."""
    if isinstance(tree, float):
        return None if math.isfinite(tree) else (prefix, tree)
    allowed: tuple[str, ...] = ()
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        allowed = tuple(getattr(type(tree), "allow_inf", ()))
        tree = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    if isinstance(tree, dict):
        children = [(k, f"{prefix}.{k}" if prefix else str(k), v) for k, v in tree.items()]
    elif isinstance(tree, (list, tuple)):
        children = [(None, f"{prefix}[{i}]", v) for i, v in enumerate(tree)]
    else:
        return None
    for name, key, value in children:
        if name in allowed and value == math.inf:
            continue
        found = first_nonfinite(value, key)
        if found is not None:
            return found
    return None
