"""What a training run reports when something stops it mid-run. In every case the traceback goes to error.log
and the last step whose update is in the weights is checkpointed first (unless that is what failed). Then:

- a known failure (a UserError: bad data, a refused weight sync, ...; an OSError: a full disk, a missing file;
  a MemoryError)
  becomes one line naming the stage and the error, what was kept, and how to resume, if anything can be resumed;
- Ctrl-C or SIGTERM becomes one line: interrupted at step N, what was kept, how to resume;
- anything else is a bug in qarl: the same line about what was kept, then the exception with its traceback."""

from __future__ import annotations

import sys
import traceback
from typing import Any, Optional

from qarl_cli.config.errors import UserError


class StageFailed(UserError, RuntimeError):
    """A stage failed mid-run for a known reason; the run stopped after keeping what it had learned."""


class Interrupted(UserError):
    """The run was stopped by Ctrl-C or SIGTERM, after keeping what it had learned. Exit code: the shell's for
    the signal (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int = 130) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def stopped(run: Any, stage: str, trained: int, saved: int, error: BaseException) -> Optional[BaseException]:
    """The one-line error that ends the run, or None for a bug (the caller re-raises it, traceback and all)."""
    from qarl_cli.train import state

    log = run.run_dir / ("error.log" if run.dist.main else f"error.rank{run.dist.rank}.log")
    log.write_text("".join(traceback.format_exception(error)))
    kept = _keep(run, stage, trained, saved)
    latest = state.latest(run.run_dir) if run.dist.main else None
    resume = f"; resume with resume={run.run_dir}" if latest is not None else ""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):  # Ctrl-C; SIGTERM (qarl_cli.machine.signals.Terminated)
        from qarl_cli.machine.signals import Terminated

        how = "interrupted" if isinstance(error, KeyboardInterrupt) else \
            str(error) if isinstance(error, Terminated) else "stopped (SystemExit)"
        code = 130 if isinstance(error, KeyboardInterrupt) else error.code if isinstance(error.code, int) else 1
        return Interrupted(f"{how} at step {trained} (during {stage}); {kept}{resume}", code)
    if isinstance(error, state.DiskFull):  # the step's checkpoint: the message names the device and what is intact
        return StageFailed(f"{error}; traceback in {log}")
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    what = f"{stage} failed at step {trained + (stage != 'checkpoint')} ({type(error).__name__}: {first})"
    if isinstance(error, (UserError, OSError, MemoryError)):
        return StageFailed(f"{what}; {kept}; traceback in {log}{resume}")
    print(f"qarl train: {what}; {kept}{resume}; a bug in qarl, traceback below and in {log}", file=sys.stderr)
    return None


def _keep(run: Any, stage: str, trained: int, saved: int) -> str:
    """Checkpoint step `trained` unless it is already saved, nothing trained, a dry run, or the checkpoint
    itself is what failed; say what the run directory holds."""
    from qarl_cli.train import state

    if run.cfg.dry_run:
        return "nothing kept (dry run)"
    if stage == "checkpoint":
        return "the checkpoint was not written" + _previous(run)
    if trained == 0:
        return "nothing trained yet, no checkpoint"
    if trained == saved:
        return f"the checkpoint of step {saved} holds it"
    try:
        return f"checkpoint {state.save(run.run_dir, trained, run.model, run.learner, run.source, {})} written"
    except Exception as e:  # noqa: BLE001 - report it; the original error is what stopped the run
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"the final checkpoint failed too ({type(e).__name__}: {first})" + _previous(run)


def _previous(run: Any) -> str:
    from qarl_cli.train import state

    latest = state.latest(run.run_dir) if run.dist.main else None
    return f"; {latest} is intact" if latest is not None else "; no earlier checkpoint exists"
