"""Runs one qarl command through Hydra: checks the overrides first (one-line errors, exit code 2), then lets
`hydra.main` compose the config, create the run directory and launch the job(s), multirun included."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from qarl_cli.config.errors import ConfigError, UserError
from qarl_cli.config.registry import GROUPS, conf_dir, one_line, options, register, run_id, validate

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's code for a command stopped by SIGINT
STOP_SWEEP = (EXIT_INTERRUPTED, 143)  # Ctrl-C and SIGTERM stop a whole sweep, not one job of it


def run_command(command: str, args: list[str]) -> int:
    from qarl_cli.machine import signals

    signals.install()  # SIGTERM unwinds like an error: checkpoints kept, children and scratch cleaned
    register()
    run_id.cache_clear()  # a new run directory for every command, even two in one process
    from hydra._internal.utils import get_args_parser

    parsed = get_args_parser().parse_args(args)
    if not (parsed.help or parsed.hydra_help or parsed.info or parsed.shell_completion):
        try:
            record = precheck(command, parsed.overrides, allow_missing=parsed.cfg is not None,
                              multirun=parsed.multirun)
        except ConfigError as e:
            print(f"qarl {command}: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        if record and not parsed.multirun and parsed.cfg is None:
            args = [*args, f"hydra.output_subdir={record}"]
    try:
        return _run_hydra(command, args)
    except KeyboardInterrupt:  # before or after the job's own handling (train reports its steps itself)
        print(f"qarl {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def precheck(command: str, overrides: list[str], allow_missing: bool = False, multirun: bool = False) -> str | None:
    """Compose and validate before Hydra runs anything, so a typo fails in one line, before any model loads.
    Each value of a sweep is checked (the others held at their first value), and so are the paths the command
    would replace (its `check_paths(cfg, run_dir)`, where it has one: Hydra writes into the run directory as
    it starts, so a refusal later would already have touched it; `--cfg` runs nothing). Returns where Hydra should record
    this launch's config when the run directory already holds a record (a resume, or a run refused for
    holding one): in a sub-directory of its own, so the record of what the run did is never rewritten."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(one_line(e)) from None
    choices = []  # per override: the plain overrides it stands for
    for ov in parsed:
        prefix = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(ov.type.name, "")
        key = ov.get_key_element()
        values = list(ov.sweep_string_iterator()) if ov.is_sweep_override() else [None]
        if ov.key_or_group in GROUPS or ov.key_or_group == "experiment":
            for v in values:
                _check_option(ov.key_or_group, v if v is not None else ov.value())
        choices.append([ov.input_line] if values == [None] else [f"{prefix}{key}={v}" for v in values])
    variants = [[c[0] for c in choices]]
    for i, c in enumerate(choices):
        variants += [[*variants[0][:i], v, *variants[0][i + 1:]] for v in c[1:]]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None, job_name=command):
        for variant in variants:
            try:
                cfg = compose(config_name=command, overrides=variant, return_hydra_config=True)
            except (HydraException, OmegaConfBaseException) as e:
                raise ConfigError(_compose_error(e, command, variant)) from None
            typed = validate(cfg, command, allow_missing, variant)
            run_dir = Path(str(cfg.hydra.sweep.dir if multirun else cfg.hydra.run.dir))
            check = getattr(importlib.import_module(f"qarl_cli.commands.{command}"), "check_paths", None)
            if check is not None and not allow_missing:
                check(typed, run_dir)
        run_dir = Path(str(cfg.hydra.run.dir))
        if multirun and not allow_missing:
            _check_sweep_dir(Path(str(cfg.hydra.sweep.dir)), typed)
    GlobalHydra.instance().clear()
    if (run_dir / ".hydra" / "config.yaml").is_file():
        return f".hydra/{run_id()}"
    return None


def _without(command: str, variant: list[str], key: str) -> Any:
    """The config composed without the override(s) of `key` (None if it does not compose either)."""
    from hydra import compose

    from qarl_cli.config.declared import _key_of

    try:
        return compose(config_name=command, overrides=[v for v in variant if _key_of(v) != key])
    except Exception:  # noqa: BLE001 - only a better message is lost: the caller says what it can
        return None


def _check_sweep_dir(sweep: Path, typed: Any) -> None:
    """A sweep into a directory that holds one would have Hydra rewrite its multirun.yaml and each job's .hydra/
    records, and the new summary replace the old, before any job is refused for holding a run: refused unless
    overwrite=true (or a resume) says the existing runs are meant."""
    found = [n for n in ("multirun.yaml", "summary.json") if (sweep / n).is_file()]
    if sweep.is_dir():
        from qarl_cli.train.rundir import holds_run

        found += sorted((p.name for p in sweep.iterdir() if p.is_dir() and holds_run(p)), key=lambda n: (len(n), n))
    if not found or getattr(typed, "overwrite", False) or getattr(typed, "resume", None):
        return
    shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    replace = ", or replace its runs with overwrite=true" if hasattr(typed, "overwrite") else ""
    raise ConfigError(f"hydra.sweep.dir={str(sweep)!r} already holds a sweep ({shown}): give this sweep a new "
                      f"directory (the default is a new one per launch){replace}")


def _check_option(group: str, value: Any) -> None:
    allowed = options(group)
    if value is not None and str(value) not in allowed:
        raise ConfigError(f"{group}={value!r} is not an option of '{group}'; choose from: {', '.join(allowed)}")


def _compose_error(err: BaseException, command: str = "", variant: list[str] = ()) -> str:
    cause = err.__cause__ or err.__context__
    key = getattr(cause, "full_key", None)
    if command and key and str(cause).startswith("Key ") and " not in " in str(cause):
        known = _without(command, variant, key)  # a misspelt existing key: name the closest one, as for +key=
        if known is not None:
            from qarl_cli.config.declared import not_a_setting

            return not_a_setting(known, key, command, variant)
    if cause is not None and "full_key" in str(cause):
        return one_line(cause)
    return one_line(err)


def _scrub_record(typed: Any, run_dir: Path) -> None:
    """Hydra wrote the composed config and the overrides (a key given on the command line among them) before the
    job started: the key is replaced by the fact that one was set (config.secrets)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from qarl_cli.config import secrets

    hc = HydraConfig.get()
    files = [run_dir / str(hc.output_subdir) / f for f in ("config.yaml", "overrides.yaml", "hydra.yaml")] \
        if hc.output_subdir else []
    if hc.mode == RunMode.MULTIRUN:
        files.append(Path(hc.sweep.dir) / "multirun.yaml")
    found = secrets.values(typed)
    secrets.scrub_files(files, found)
    # What libraries record of the command line for the job (wandb keeps sys.argv in its run's metadata);
    # _run_hydra puts the real one back when the job ends
    sys.argv = [secrets.scrub(arg, found) for arg in sys.argv]


def _sweeping() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _job_failed(command: str, err: Exception, run_dir: Path) -> None:
    """One line naming the job and why it failed (a bug's traceback too), and its status.json unless the command
    wrote one: the sweep goes on, and its summary lists the job as failed."""
    from qarl_cli.results.runs import FAILED, STATUS, write_status

    why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if not isinstance(err, UserError):
        import traceback

        traceback.print_exception(err, file=sys.stderr)
        why = f"{type(err).__name__}: {why}"
    print(f"qarl {command}: job {run_dir} failed: {why}; the sweep goes on", file=sys.stderr)
    if not (run_dir / STATUS).is_file() and not getattr(err, "not_ours", False):  # not another live run's dir
        write_status(run_dir, FAILED, why)


def _run_hydra(command: str, args: list[str]) -> int:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    codes: list[int] = []

    @hydra.main(version_base=None, config_path=str(conf_dir()), config_name=command)
    def job(cfg: Any) -> None:
        try:
            typed = validate(cfg, command, overrides=list(HydraConfig.get().overrides.task))
        except ConfigError as e:
            print(f"qarl {command}: error: {e}", file=sys.stderr)
            raise SystemExit(EXIT_USAGE) from None
        impl = importlib.import_module(f"qarl_cli.commands.{command}")
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        _scrub_record(typed, run_dir)
        from qarl_cli.config.library_logs import routed

        try:
            with routed(run_dir, getattr(typed, "verbose", True)):
                codes.append(int(impl.run(typed, run_dir) or 0))
        except Exception as e:  # noqa: BLE001 - in a sweep, one job's failure is recorded and the others run
            code = getattr(e, "exit_code", EXIT_USAGE if isinstance(e, ConfigError) else 1)
            if _sweeping() and code not in STOP_SWEEP:
                codes.append(code)
                _job_failed(command, e, run_dir)
                return
            if not isinstance(e, UserError):  # a bug: its traceback
                raise
            print(f"qarl {command}: error: {e}", file=sys.stderr)  # a bad path, file or value: one line
            raise SystemExit(code) from None

    if int(os.environ.get("RANK", "0")) > 0:  # torchrun: rank 0 writes the run directory's .hydra/
        args = [*args, "hydra.output_subdir=null"]
    argv = sys.argv
    sys.argv = [f"qarl {command}", *args]
    try:
        job()
    except SystemExit as e:
        from qarl_cli.machine.signals import Terminated

        if isinstance(e, Terminated):  # outside the training loop, which reports its own step
            print(f"qarl {command}: {e}", file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return max(codes, default=0)
