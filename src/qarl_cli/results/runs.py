"""A run directory read back: its step records (metrics.jsonl), the overrides it was launched with
(.hydra/overrides.yaml) and how it ended (status.json, written by `qarl train`; inferred for runs older than it).
`expand` turns what a user names (a run directory, or a directory of runs such as a sweep's) into run directories;
anything else is a NotARun, one line naming the path."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

METRICS = "metrics.jsonl"
STATUS = "status.json"
FINISHED, FAILED, INTERRUPTED, UNFINISHED = "finished", "failed", "interrupted", "unfinished"


class NotARun(Exception):
    """A path given as a run or sweep directory that is not one, or a record in it that cannot be read: the
    input's fault, one line (not a config.errors.UserError: this package imports nothing of qarl's outside it,
    so no other package's imports lead back into it)."""


@dataclass
class Run:
    path: Path
    rows: list[dict] = field(default_factory=list)  # metrics.jsonl, one dict per line
    overrides: list[str] = field(default_factory=list)
    status: str = UNFINISHED
    error: Optional[str] = None  # why it failed, one line

    @property
    def name(self) -> str:
        return self.path.name


def is_run_dir(path: Path) -> bool:
    # A job that failed before its first step has its .hydra record but no metrics: still a run, shown as failed.
    return (path / METRICS).is_file() or (path / ".hydra" / "config.yaml").is_file()


def expand(paths: list[Path]) -> list[Path]:
    """Run directories: each path itself when it is one, else the run directories right under it (a sweep)."""
    out: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise NotARun(f"{path} does not exist or is not a directory")
        if is_run_dir(path):
            out.append(path)
            continue
        jobs = sorted((p for p in path.iterdir() if p.is_dir() and is_run_dir(p)), key=_job_order)
        if not jobs:
            raise NotARun(f"{path} is not a qarl run or sweep directory (no {METRICS} in it or its sub-directories)")
        out += jobs
    return out


def _job_order(path: Path) -> tuple:
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)  # a sweep's 0, 1, ..., 10


def load_metrics(run_dir: Path, name: str = METRICS) -> list[dict]:
    path = run_dir / name
    if not path.is_file():
        return []
    rows, lines = [], path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines):  # a run killed mid-write leaves half a last line
                break
            raise NotARun(f"{path}: line {n} is not JSON ({e.msg})") from None
    return rows


def read(run_dir: Path, metrics: str = METRICS) -> Run:
    status, error = status_of(run_dir)
    return Run(run_dir, load_metrics(run_dir, metrics), overrides_of(run_dir), status, error)


def overrides_of(run_dir: Path) -> list[str]:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    import yaml

    return [str(o) for o in yaml.safe_load(path.read_text()) or []]


def write_status(run_dir: Path, status: str, error: Optional[str] = None) -> None:
    """Written beside and renamed over: a kill mid-write leaves the earlier record whole, never a cut one."""
    tmp = run_dir / f".{STATUS}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps({"status": status, "error": error}) + "\n")
    os.replace(tmp, run_dir / STATUS)


def status_of(run_dir: Path) -> tuple[str, Optional[str]]:
    """(status, why it failed) from status.json; for a run without one: finished when it wrote its summary or
    logged its last step, failed when it left an error.log (its last line), else unfinished (killed, or running)."""
    path = run_dir / STATUS
    if path.is_file():
        record = json.loads(path.read_text())
        return record["status"], record.get("error")
    if (run_dir / "summary.json").is_file() or _reached_last_step(run_dir):
        return FINISHED, None
    if (run_dir / "error.log").is_file():
        lines = [ln for ln in (run_dir / "error.log").read_text().splitlines() if ln.strip()]
        return FAILED, lines[-1].strip() if lines else "error.log"
    return UNFINISHED, None


def _reached_last_step(run_dir: Path) -> bool:
    config = run_dir / ".hydra" / "config.yaml"
    rows = load_metrics(run_dir)
    if not rows or not config.is_file():
        return False
    import yaml

    steps = (yaml.safe_load(config.read_text()) or {}).get("steps")
    return isinstance(steps, int) and rows[-1].get("step") == steps


def common_overrides(runs: list[Run]) -> list[str]:
    """The overrides every run was launched with (a sweep's fixed settings)."""
    return [o for o in runs[0].overrides if all(o in r.overrides for r in runs[1:])] if runs else []


def labels(runs: list[Run]) -> list[str]:
    """Each run's directory name (with its parent's where two share a name, as two sweeps' job 0 do), then the
    overrides that set it apart from the others."""
    common = set(common_overrides(runs)) if len(runs) > 1 else set()
    names = [r.name for r in runs]
    out = []
    for r in runs:
        name = f"{r.path.parent.name}/{r.name}" if names.count(r.name) > 1 else r.name
        out.append(" ".join([name, *[o for o in r.overrides if o not in common]]) if len(runs) > 1 else name)
    return out
