"""The typed configuration: one schema per group option, stored in Hydra's ConfigStore as that option.

GROUPS is the registry: per config group, option name -> schema dataclass. A schema holds the option's defaults
(each in exactly one place), its validators (`__post_init__`) and, in its `impl` class attribute, the
implementation (`module:attr`, imported lazily by qarl_cli.stages). There are no per-option YAML files; only the
experiment presets (conf/experiment/) are YAML. Validation converts the composed config into the dataclasses,
which runs their validators; errors become one line naming the key and the value."""

from __future__ import annotations

import copy
import functools
import importlib.resources
import os
import secrets
import time
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from qarl_cli.config import algorithm, data, model, quant, reward, root, stages
from qarl_cli.config.errors import ConfigError

GROUPS: dict[str, dict[str, type]] = {
    "model": model.SCHEMAS,
    "data": data.SCHEMAS,
    "quant": quant.SCHEMAS,
    "rollout": stages.ROLLOUT_SCHEMAS,
    "reward": reward.SCHEMAS,
    "forward": stages.FORWARD_SCHEMAS,
    "algorithm": algorithm.SCHEMAS,
    "sync": stages.SYNC_SCHEMAS,
    "logger": stages.LOGGER_SCHEMAS,
}
ROOTS = root.ROOTS


def conf_dir() -> Path:
    """The shipped config tree (the repository's conf/, installed as the package `qarl_cli.conf`)."""
    return Path(str(importlib.resources.files("qarl_cli.conf")))


def options(group: str) -> list[str]:
    """The options of a config group, as a user selects them (`group=option`); experiment presets are YAML."""
    if group in GROUPS:
        return sorted(GROUPS[group])
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def command_groups(command: str) -> list[str]:
    fields = ROOTS[command].__dataclass_fields__
    return [g for g in GROUPS if g in fields]


# Every run directory gets this suffix: two runs started in the same second must not share a directory.
# Computed once per process, so all interpolations of the run directory agree.
# Under torchrun every rank composes the config: the launch's id (shared by its ranks) names the directory.
@functools.lru_cache(maxsize=None)
def run_id() -> str:
    launch = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if launch != "none" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"torchrun-{launch[:13]}"
    return f"{time.strftime('%H-%M-%S')}-{secrets.token_hex(3)}"


def hydra_settings(command: str, option_lists: dict[str, list[str]]) -> dict:
    """Hydra's own settings for one command: unique run directories, no chdir, and a help page that lists
    the command's groups (Hydra's default page would also list the internal schema/ groups)."""
    from qarl_cli.config.library_logs import job_logging

    groups = "\n".join(f"  {g}: {', '.join(opts)}" for g, opts in option_lists.items())
    template = (f"qarl {command}: {{COMMAND_HELP}}\n\nusage: qarl {command} [GROUP=OPTION ...] [KEY=VALUE ...] "
                f"[+experiment=NAME] [-m] [--cfg job]\n\n== Config groups (GROUP=OPTION) ==\n{groups}\n\n"
                "== Composed config (override any KEY=VALUE) ==\n$CONFIG\n== Hydra flags ==\n$FLAGS_HELP")
    return {
        "run": {"dir": "outputs/${now:%Y-%m-%d}/${qarl_run_id:}"},
        "sweep": {"dir": "multirun/${now:%Y-%m-%d}/${qarl_run_id:}", "subdir": "${hydra.job.num}"},
        "job": {"chdir": False, "name": command},
        "job_logging": job_logging(),  # libraries' records into the run's engine.log (qarl_cli.config.library_logs)
        "help": {"app_name": f"qarl {command}", "template": template},
    }


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for command, schema in ROOTS.items():
        cs.store(name=f"{command}_schema", node=schema)
    for group, schemas in GROUPS.items():
        for name, schema in schemas.items():
            cs.store(group=group, name=name, node=schema)
    from qarl_cli.config.usage import COMMANDS

    for command in ROOTS:
        lists = {g: options(g) for g in [*command_groups(command), *(["experiment"] if command == "train" else [])]}
        node = hydra_settings(command, lists)
        node["help"]["template"] = node["help"]["template"].replace("{COMMAND_HELP}", COMMANDS[command])
        cs.store(name=f"hydra_{command}", package="hydra", node=node)
    if not OmegaConf.has_resolver("qarl_run_id"):
        OmegaConf.register_new_resolver("qarl_run_id", run_id)


def validate(cfg: DictConfig, command: str, allow_missing: bool = False, overrides: Sequence[str] = ()) -> Any:
    """The composed config as typed dataclasses (validators run), or ConfigError naming the bad key.
    allow_missing: accept required values left unset (`--cfg job` may print an incomplete config).
    overrides: the command line's, to name the one that added a key no schema declares."""
    if "hydra" in cfg:  # composed with Hydra's own config: validate the job's part (a copy keeps the schema type)
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
    from qarl_cli.config.declared import check_declared
    from qarl_cli.config.domains import check_domains

    check_declared(cfg, command, overrides)  # a `+key=...` no schema has would be dropped without a word
    check_domains(cfg)  # every number in its field's domain, before the validators relate fields to each other
    for group in GROUPS:
        if group in cfg:
            _check_name(group, _to_object(cfg, group, allow_missing))
    from qarl_cli.config.finite import reject_nonfinite  # no NaN/inf anywhere, named by key

    typed = reject_nonfinite(_to_object(cfg, None, allow_missing))
    if typed is not None:
        from qarl_cli.config.engine_limits import check_engine_limits  # what vLLM and the model accept

        check_engine_limits(typed)
        from qarl_cli.config.ignored import check_ignored  # a value typed where the run would not use it

        check_ignored(typed, overrides)
    return typed


def _check_name(group: str, node: Any) -> None:
    """A group's `name` is the option chosen (the run records it, stages resolve it): not a value to set."""
    own = type(node).__dataclass_fields__["name"].default if node is not None else None
    if node is not None and node.name != own:
        raise ConfigError(f"{group}.name={node.name!r}: the name of the option chosen ({own!r}), not a setting; "
                          f"choose another with {group}=OPTION ({', '.join(sorted(GROUPS[group]))})")


def _to_object(cfg: DictConfig, group: str | None, allow_missing: bool) -> Any:
    node = cfg if group is None else cfg[group]
    prefix = "" if group is None else f"{group}."
    try:
        return OmegaConf.to_object(node)
    except ConfigError as e:
        raise ConfigError(f"{prefix}{e}") from None
    except MissingMandatoryValue as e:
        if allow_missing:
            return None
        key = getattr(e, "full_key", "") or one_line(e)
        raise ConfigError(f"{key} is required and has no default: set {key}=...") from None
    except OmegaConfBaseException as e:  # a missing value, an interpolation that does not resolve, a bad type
        raise ConfigError(one_line(e)) from None


def one_line(err: BaseException) -> str:
    """OmegaConf and Hydra errors span several lines; keep the message and the full key."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), "")
    msg = lines[0] if lines else type(err).__name__
    return f"{key}: {msg}" if key and key not in msg else msg
