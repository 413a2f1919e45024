"""Only settings a schema declares: `+key=value` adds a key to the composed config whatever it is, and converting
the config to its dataclasses drops the keys they do not have, so a misspelt `+train_threadz=2` would be ignored
without a word. Every key of the job's config must be a field of the schema of the node that holds it; free-form
mappings (a Dict field such as data.chat_template_kwargs) hold any key. Experiment presets are a config group,
not a key: they leave nothing of their own name in the job's config."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from qarl_cli.config.errors import ConfigError


def check_declared(cfg: DictConfig, command: str, overrides: Sequence[str] = ()) -> None:
    """ConfigError naming the first key no schema declares (and the override that added it, if one did), with
    the closest declared key suggested."""
    key = next(_undeclared(cfg, ""), None)
    if key is not None:
        raise ConfigError(not_a_setting(cfg, key, command, overrides))


def not_a_setting(cfg: DictConfig, key: str, command: str, overrides: Sequence[str] = ()) -> str:
    """The one line for a key no schema of `cfg` declares: the override that named it, whose setting it is not,
    and the closest declared key (a misspelt `lrr=1` as well as `+lrr=1`)."""
    group, nested, _ = key.partition(".")
    owner = f"{group}={cfg[group].name}" if nested and group in cfg and "name" in cfg[group] else f"qarl {command}"
    close = _closest(key, list(_keys(cfg, "")))
    hint = f" (did you mean {close[0]}?)" if close else f" (qarl {command} --cfg job lists every setting)"
    given = next((f"{ov}: " for ov in overrides if _key_of(ov) == key or _key_of(ov).startswith(f"{key}.")), "")
    return f"{given}{key!r} is not a setting of {owner}{hint}"


def _undeclared(node: DictConfig, prefix: str) -> Iterator[str]:
    schema = OmegaConf.get_type(node)
    if schema is None or not dataclasses.is_dataclass(schema):
        return  # a free-form mapping: any key
    fields = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys():
        if key not in fields:
            yield f"{prefix}{key}"
        elif isinstance(child := node._get_node(key), DictConfig) and not child._is_missing():
            yield from _undeclared(child, f"{prefix}{key}.")


def _keys(node: DictConfig, prefix: str) -> Iterator[str]:
    """The declared keys, dotted (the suggestions)."""
    schema = OmegaConf.get_type(node)
    if schema is None or not dataclasses.is_dataclass(schema):
        return
    for f in dataclasses.fields(schema):
        yield f"{prefix}{f.name}"
        if f.name in node and isinstance(child := node._get_node(f.name), DictConfig) and not child._is_missing():
            yield from _keys(child, f"{prefix}{f.name}.")


def _key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _closest(key: str, known: list[str]) -> list[str]:
    """The declared key closest to `key`: a sibling first (`rollout.base_prot`), else one of (nearly) the same name
    anywhere (`+base_port=...` for rollout.base_port)."""
    parent, _, name = key.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(name, list(siblings), n=1)
    if close:
        return [siblings[close[0]]]
    names = {k: k.rpartition(".")[2] for k in known}
    near = difflib.get_close_matches(name, list(names.values()), n=1, cutoff=0.85)
    return [k for k in known if names[k] in near][:1]
