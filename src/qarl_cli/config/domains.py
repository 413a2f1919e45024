"""Every number in a config within its documented domain: one check over the composed config, driven by the
schemas' own tables. Each schema declares the domain of each of its int and float fields (Optional ones too: None
stays allowed) once, beside the fields:

    DOMAINS: ClassVar[dict] = {"grad_clip": ge(0, "0: no clipping"), "seed": ANY}

Tables merge over the class's MRO, so an option inherits its base's domains and may override one. A value
outside its domain fails in one line naming the key as the user writes it (`rollout.base_port=-5: must be in
0..65535 (0: ...)`). Rules that relate several fields stay in the schemas' __post_init__; NaN and infinity are
qarl_cli.config.finite's (one message for them everywhere)."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, Iterator, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from qarl_cli.config.errors import ConfigError, Domain


@functools.lru_cache(maxsize=None)
def domains(schema: type) -> dict[str, Domain]:
    """The schema's DOMAINS merged over its MRO (a subclass's entry replaces its base's)."""
    merged: dict[str, Domain] = {}
    for cls in reversed(schema.__mro__):
        merged.update(cls.__dict__.get("DOMAINS", {}))
    return merged


@functools.lru_cache(maxsize=None)
def numeric_fields(schema: type) -> dict[str, bool]:
    """name -> whether an int (else float) of the schema's fields typed int, float or Optional of either."""
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        kind = hints.get(f.name)
        if typing.get_origin(kind) is Union:
            args = [a for a in typing.get_args(kind) if a is not type(None)]
            kind = args[0] if len(args) == 1 else None
        if kind in (int, float):
            out[f.name] = kind is int
    return out


def check_domains(tree: Any, prefix: str = "") -> None:
    """ConfigError for the first number outside its field's domain. `tree`: a composed DictConfig (checked before
    the schemas' own validators run, so that a count of 0 is named as such, not through a rule relating it to
    another field) or a schema instance; nested schemas are walked with their key as prefix."""
    for key, value, domain, integer in _numbers(tree, prefix):
        if not domain.allows(value):
            raise ConfigError(f"{key}={value!r}: {domain.rule(integer)}")


def _numbers(tree: Any, prefix: str) -> Iterator[tuple[str, float, Domain, bool]]:
    schema = _schema(tree)
    if schema is None:
        return
    table, numeric = domains(schema), numeric_fields(schema)
    for f in dataclasses.fields(schema):
        value = _get(tree, f.name)
        if _schema(value) is not None:
            yield from _numbers(value, f"{prefix}{f.name}.")
        elif f.name in numeric and f.name in table and _is_number(value):
            yield f"{prefix}{f.name}", value, table[f.name], numeric[f.name]


def _schema(node: Any) -> type | None:
    if isinstance(node, DictConfig):
        kind = OmegaConf.get_type(node)
        return kind if kind is not None and dataclasses.is_dataclass(kind) else None
    return type(node) if dataclasses.is_dataclass(node) and not isinstance(node, type) else None


def _get(tree: Any, name: str) -> Any:
    """The field's value; None where there is none to check here: missing (the validators report it) or an
    interpolation (`${data.max_new_tokens}`: the value is checked where it is set, under the key the user set)."""
    if not isinstance(tree, DictConfig):
        return getattr(tree, name, None)
    if name not in tree or OmegaConf.is_missing(tree, name) or OmegaConf.is_interpolation(tree, name):
        return None
    try:
        return tree[name]
    except OmegaConfBaseException:
        return None


def _is_number(value: Any) -> bool:
    """A value to check: not None, not an unresolved interpolation (a str), not NaN or inf (finite.py's)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
