"""Whose lines reach the console. qarl's own lines (its `[qarl]` lines, the progress bar, the `qarl` logger) go to
the console; vLLM's and the other libraries' log records and Python warnings go to `<run dir>/engine.log`, and of
those only errors reach the console too; the libraries' weight-loading progress bars are off. `verbose=true` puts every record on the console as well (engine.log still gets them).

Two routes, because vLLM keeps its records to itself: it gives its `vllm` logger its own handler (propagate off)
from a logging config it applies at import and again whenever an engine starts, in every engine process. Its
supported way in is that config: VLLM_LOGGING_CONFIG_PATH names a dictConfig file (vllm.config.logging), read by
this process and inherited by engine-core processes, so theirs land in the same file. Launched servers do not
inherit it (rollout.server_launch): each server's lines go to its own server-N.log. Every other library logs
through the root logger, whose handlers Hydra sets up from `hydra.job_logging` (config.registry): a console handler
with `ConsoleFilter` and a file handler on engine.log."""

from __future__ import annotations

import json
import logging
import logging.config
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOG_FILE = "engine.log"
CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"
CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"
FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


class ConsoleFilter(logging.Filter):
    """The root console handler's filter: qarl's records, and other libraries' errors (verbose: everything)."""

    verbose = False

    def filter(self, record: logging.LogRecord) -> bool:
        return (self.verbose or record.levelno >= logging.ERROR or record.name == "qarl"
                or record.name.startswith("qarl."))


def job_logging() -> dict:
    """Hydra's `hydra.job_logging` for qarl's commands: the root logger's handlers (Hydra applies it per job)."""
    return {
        "version": 1,
        "formatters": {"simple": {"format": FORMAT}},
        "filters": {"console": {"()": "qarl_cli.config.library_logs.ConsoleFilter"}},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "simple", "stream": "ext://sys.stdout",
                        "filters": ["console"]},
            "file": {"class": "logging.FileHandler", "formatter": "simple", "delay": True,
                     "filename": f"${{hydra.runtime.output_dir}}/{LOG_FILE}"},
        },
        "root": {"level": "INFO", "handlers": ["console", "file"]},
        "disable_existing_loggers": False,
    }


def vllm_logging(path: Path) -> dict:
    """vLLM's loggers: every record into `path` (appended to by each engine process), errors on stderr too."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S",
                                "format": "(%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] "
                                          "%(message)s"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "formatter": "vllm", "filename": str(path), "delay": True},
            "console": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "ERROR",
                        "stream": "ext://sys.stderr"},
        },
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }


_quiet = False


def quiet() -> bool:
    """Whether the libraries' progress bars stay off the console (a command without verbose=true is running)."""
    return _quiet


@contextmanager
def routed(run_dir: Path, verbose: bool) -> Iterator[None]:
    """For one command: vLLM's records into run_dir/engine.log (unless verbose), the console filter set, Python
    warnings logged (to the file) rather than printed, torch's C++ warnings (printed by its own logger, e.g. the
    engine's NUMA binding note) and the libraries' weight-loading progress bars off; all put back afterwards
    (tests run many commands in one process)."""
    global _quiet
    ConsoleFilter.verbose = verbose
    saved_env = {k: os.environ.get(k) for k in (CONFIG_ENV, CPP_LOG_ENV)}
    vllm_logger = logging.getLogger("vllm")
    saved = (list(vllm_logger.handlers), vllm_logger.level, vllm_logger.propagate)
    bars = None
    try:
        if not verbose:
            config = run_dir / ".hydra" / "vllm_logging.json"
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(json.dumps(vllm_logging(run_dir / LOG_FILE), indent=1))
            os.environ[CONFIG_ENV] = str(config)
            if "vllm.logger" in sys.modules:  # vLLM configured itself already (an earlier command)
                logging.config.dictConfig(vllm_logging(run_dir / LOG_FILE))
            os.environ.setdefault(CPP_LOG_ENV, "ERROR")  # read when torch loads: the CLI imports it after this
            logging.captureWarnings(True)
            bars, _quiet = _progress_bars(False), True
        yield
    finally:
        ConsoleFilter.verbose, _quiet = False, False
        logging.captureWarnings(False)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for handler in vllm_logger.handlers:
            if handler not in saved[0]:
                handler.close()
        vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate = saved
        if bars is not None:
            _progress_bars(bars)


def _progress_bars(on: bool) -> bool | None:
    """Turn transformers' progress bars (its weight-loading bar) on or off; whether they were on (None: no
    transformers)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return None
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if on else hf_logging.disable_progress_bar)()
    return was
