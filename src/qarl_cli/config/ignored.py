"""A setting the run would not use is refused, not dropped: a value the user types either acts or is named. Some
fields only act beside another value (a test split held out of data.path, samples of an evaluation that never
runs); set on the command line where that other value turns them off, they would be ignored with exit 0, and the
user would believe the run used them. Presets are not checked here: what a preset sets is its author's choice,
and the user did not type it.

Each rule: the key, when it is ignored (on the validated config), and why, in the words of the refusal."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from qarl_cli.config.errors import ConfigError

RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("data.test_size", lambda c: bool(getattr(c.data, "test_path", None)),
     "the test split is data.test_path's problems; test_size holds problems out of data.path only when "
     "data.test_path is unset"),
    ("eval_samples", lambda c: c.eval_every == 0, "eval_every=0 evaluates nothing; set eval_every=N to evaluate"),
    ("sync.verify_tolerance", lambda c: c.sync.verify_every == 0,
     "sync.verify_every=0 never verifies; set sync.verify_every=N to verify every N syncs"),
]


def check_ignored(typed: Any, overrides: Sequence[str]) -> None:
    """ConfigError naming the first override whose key a rule says this config would not use."""
    from qarl_cli.config.declared import _key_of

    given = {_key_of(ov): ov for ov in overrides if "=" in ov and not ov.startswith("~")}
    for key, ignored, why in RULES:
        if key in given and _holds(typed, key) and ignored(typed):
            raise ConfigError(f"{given[key]}: not used by this run ({why})")


def _holds(typed: Any, key: str) -> bool:
    node = typed
    for part in key.split("."):
        if not hasattr(node, part):
            return False
        node = getattr(node, part)
    return True
