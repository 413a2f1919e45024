"""A run directory holds one run, written by one live process.

- `claim`: an exclusive lock (flock on `.qarl.lock`) held for the life of the process; the kernel drops it when
  the process dies, however it dies, so a crashed run never blocks its own resume. A second `qarl train` into
  the same directory stops in one line naming the holder's pid.
- `check_paths`: at compose time, before Hydra writes into the directory: a run directory apart from the
  checkpoint it starts from; a fresh run refused where a run is, unless overwrite=true; a resume of another
  directory's checkpoint refused into a directory that holds a run of its own (resume tidies that directory's
  records); overwrite=true and resume never together.
- `check_fresh`, `set_aside`, `drop_replaced`: a run without `resume` into a directory that already holds a run
  (checkpoints or metrics) is refused, unless `overwrite=true` says to replace it. The replaced run's records
  are moved aside (`.replaced-*`, a rename on the same file system) and removed only once the new run has
  written its first checkpoint or finished: a run that fails before that leaves them there, said in one line.
- `check_resume`: what may change when a run is resumed. The trained weights and the trainer state came from
  the checkpoint's config; a key that shapes them (model, data, quant, algorithm, lr, ...) is refused by name.
  Keys in RESUMABLE only say how long to run, how often to evaluate or save, where to log and what resources
  to use.
- `tidy_for_resume`: the records of an interrupted run are cut back to its checkpoint (metrics.jsonl keeps the
  lines of steps <= the checkpoint's), and partly written checkpoints are removed, so that a resumed run's
  records equal an uninterrupted run's."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from qarl_cli.config.errors import ConfigError, UserError

LOCK = ".qarl.lock"
PREFIX = "step_"  # checkpoints/step_NNNNNN/
CONFIG = "config.json"  # the run's config, beside each checkpoint's trainer.pt
# Keys (or prefixes ending in ".") that may differ between a checkpoint's config and its resume.
RESUMABLE = ("steps", "resume", "overwrite", "verbose", "eval_every", "eval_samples", "checkpoint_every", "train_threads",
             "logger.", "model.cache_dir", "reward.num_workers", "reward.timeout_s", "reward.kill_grace_s",
             "reward.worker_memory_mb", "rollout.gpu_memory_utilization", "rollout.kv_cache_memory_bytes",
             "rollout.enforce_eager", "rollout.batch_size", "sync.verify_every", "sync.verify_tolerance")
_held: list[Any] = []  # open lock files: the lock lasts as long as the process


class RunDirInUse(UserError, RuntimeError):
    """Another live process writes this run directory."""

    not_ours = True  # the directory is that process's: a sweep records nothing in it for this job


def claim(run_dir: Path) -> None:
    """Take the run directory for this process (idempotent), or RunDirInUse."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    if any(getattr(f, "name", None) == str(path) for f in _held):
        return
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunDirInUse(f"run directory {run_dir} is in use by another qarl train (pid {holder}); wait for it "
                          "to end, or give this run its own hydra.run.dir") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _held.append(f)


def holds_run(run_dir: Path) -> bool:
    """Whether the directory already holds a run's results (checkpoints or step records)."""
    ckpts = run_dir / "checkpoints"
    return (run_dir / "metrics.jsonl").exists() or (ckpts.is_dir() and any(ckpts.iterdir()))


REPLACED = ("checkpoints", "metrics.jsonl", "summary.json", "status.json", "curves.png", "error.log", "engine.log",
            "wandb")  # a run's results, which overwrite=true replaces (the .hydra/ records are kept)
ASIDE = ".replaced-"


def check_paths(run_dir: Path, cfg: Any) -> None:
    """Every refusal that depends on what is on disk, before anything is written (see the module's doc)."""
    from qarl_cli.machine.disk import refuse_overlap

    model_path, data_path = getattr(cfg.model, "path", None), getattr(cfg.data, "path", None)
    refuse_overlap("hydra.run.dir", run_dir, [("model.path", model_path)], "a run directory holds one run and "
                   "its checkpoints: give it a directory apart from the checkpoint the run starts from")
    if cfg.resume and cfg.overwrite:
        raise ConfigError(f"overwrite=true with resume={str(cfg.resume).lower() if cfg.resume in ('true', 'True') else cfg.resume!r}: a resume continues the run where it is, "
                          "overwrite=true replaces it; choose one")
    if cfg.resume:
        find_resume(cfg.resume, run_dir)  # a checkpoint there, and intact: else refused before Hydra writes
        if cfg.resume not in ("true", "True") and holds_run(run_dir) \
                and Path(os.path.expanduser(cfg.resume)).resolve() not in {run_dir.resolve(), *_below(run_dir)}:
            raise ConfigError(f"resume={cfg.resume!r} into hydra.run.dir={str(run_dir)!r}, which holds a run of its "
                              "own: a resume cuts its directory's records back to the checkpoint; resume into "
                              "the checkpoint's own run directory or a new one")
        return
    check_fresh(run_dir, cfg.overwrite)
    if cfg.overwrite:
        for name in REPLACED:
            refuse_overlap("overwrite=true replaces", run_dir / name,
                           [("model.path", model_path), ("data.path", data_path)],
                           "it would remove what this run reads; move it out of the run directory first")


def _below(run_dir: Path) -> list[Path]:
    """The checkpoints of `run_dir` and their parent: the resume targets that belong to this directory."""
    ckpts = run_dir / "checkpoints"
    return [ckpts.resolve(), *(p.resolve() for p in ckpts.glob("step_*"))] if ckpts.is_dir() else []


def check_fresh(run_dir: Path, overwrite: bool) -> None:
    """A fresh run may only start in a directory that holds no run, or replace it when told to."""
    if holds_run(run_dir) and not overwrite:
        if not any((run_dir / "checkpoints").glob("step_*/trainer.pt")):  # resume=true would find nothing
            raise ConfigError(f"hydra.run.dir={str(run_dir)!r} already holds a run that stopped before its first "
                              "checkpoint (metrics.jsonl, no checkpoint to resume): replace it with "
                              "overwrite=true, or start this one in a new directory")
        raise ConfigError(f"hydra.run.dir={str(run_dir)!r} already holds a run (checkpoints / metrics.jsonl): "
                          "continue it with resume=true, start this one in a new directory, or replace it with "
                          "overwrite=true")


def set_aside(run_dir: Path) -> Optional[Path]:
    """Move the results of the run that overwrite=true replaces into a hidden directory beside them (renames:
    nothing is copied or deleted yet); None when there is nothing to replace."""
    from qarl_cli.machine import scratch

    found = [run_dir / n for n in REPLACED if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if not found:
        return None
    aside = scratch.make(run_dir, ASIDE)
    for path in found:
        os.rename(path, aside / path.name)
    return aside


def drop_replaced(run_dir: Path) -> None:
    """The new run has taken the old one's place (a checkpoint written, or finished): remove what was set aside."""
    for old in run_dir.glob(f"{ASIDE}*"):
        shutil.rmtree(old, ignore_errors=True)


def check_resume(ckpt: Path, config: dict) -> None:
    """The resumed config (flat dict of the validated TrainConfig) against the one the checkpoint was written
    with; a checkpoint without a recorded config (written before configs were recorded) is not checked."""
    path = ckpt / CONFIG
    if not path.is_file():
        return
    before, now = _flat(json.loads(path.read_text())), _flat(config)
    changed = sorted(k for k in before.keys() | now.keys()
                     if before.get(k) != now.get(k) and not any(k == r or (r.endswith(".") and k.startswith(r))
                                                                for r in RESUMABLE))
    if changed:
        shown = ", ".join(f"{k}={now.get(k)!r} (was {before.get(k)!r})" for k in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise ConfigError(f"resume={str(ckpt)!r}: {shown}{more} {'differ' if len(changed) > 1 else 'differs'} from the run being resumed; a resumed run "
                          "keeps its config except how long it runs, how often it evaluates and saves, where it "
                          "logs and the resources it uses: start a new run for the others")




def latest(root: Path) -> Optional[Path]:
    """The newest complete checkpoint under `root` (a run directory or its checkpoints/), or None."""
    root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    found = _complete(root)
    return found[-1] if found else None


def find_resume(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """`resume`: null (start fresh), "true" (the newest checkpoint of this run directory: pass
    hydra.run.dir=<the run's directory>), or a run directory or a checkpoint directory."""
    if resume in (None, "", "false", "False"):
        return None
    if resume in ("true", "True"):
        resume = "true"  # as typed: Hydra reads resume=true as a bool, the schema's str makes it "True"
    where = run_dir if resume == "true" else Path(os.path.expanduser(str(resume)))
    found = where if (where / "trainer.pt").is_file() else latest(where) if where.is_dir() else None
    if found is None:
        raise ConfigError(f"resume={resume!r}: no checkpoint in {str(where)!r} (resume=true resumes the run "
                          "directory given by hydra.run.dir=...; or pass resume=<run or checkpoint directory>)")
    bad = damaged(found)
    if bad is not None:
        older = [p for p in _complete(found.parent) if p.name < found.name and damaged(p) is None]
        then = (f"the last intact checkpoint is {older[-1]}: resume={older[-1]}" if older
                else "no earlier intact checkpoint exists")
        raise ConfigError(f"resume={resume!r}: {bad}; {then}")
    return found


def intact(ckpt: Path) -> bool:
    return damaged(ckpt) is None


def damaged(ckpt: Path) -> Optional[str]:
    """What is damaged in a checkpoint, or None. trainer.pt must be a complete torch file (a zip archive: a
    truncated one has no central directory at its end); each safetensors file of model/ must be as long as its
    header says (8 bytes of header length, the JSON header, then the tensors up to the largest end offset). Reads
    the archive's directory and the headers only, not the tensors."""
    import zipfile

    try:
        with zipfile.ZipFile(ckpt / "trainer.pt") as z:
            if not z.namelist():
                raise zipfile.BadZipFile
    except (OSError, zipfile.BadZipFile):
        return f"{ckpt / 'trainer.pt'} is damaged or truncated (not a complete torch file)"
    for weights in sorted((ckpt / "model").glob("*.safetensors")):
        why = _safetensors_damage(weights)
        if why:
            return f"{weights} is damaged or truncated ({why})"
    return None


def _safetensors_damage(path: Path) -> Optional[str]:
    import struct

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{size} bytes, shorter than its header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                return f"its header says {n} bytes of header, the file has {size}"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"unreadable header: {type(e).__name__}"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and "data_offsets" in t]
    want = 8 + n + max(ends, default=0)
    return None if size == want else f"{size} bytes where its header says {want}"


def _complete(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"{PREFIX}*") if (p / "trainer.pt").is_file())


def tidy_for_resume(run_dir: Path, step: int, metrics_file: str, main: bool) -> None:
    """Records after checkpoint `step` belong to steps that will run again: drop them (rank 0 only)."""
    if not main:
        return
    remove_partial_checkpoints(run_dir)
    path = run_dir / metrics_file
    if path.is_file():
        lines = path.read_text().splitlines()
        kept = [ln for ln in lines if ln.strip() and _step(ln) is not None and _step(ln) <= step]
        if len(kept) != len(lines):
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            tmp.write_text("".join(f"{ln}\n" for ln in kept))
            os.replace(tmp, path)


def remove_partial_checkpoints(run_dir: Path) -> None:
    """Checkpoints a killed run left half-written (the lock says no live process is writing them)."""
    for tmp in (run_dir / "checkpoints").glob(".step_*.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


def config_dict(cfg: Any) -> dict:
    """A validated TrainConfig as plain JSON-able data, secrets redacted (what a checkpoint records, check_resume
    compares and the loggers get)."""
    from omegaconf import OmegaConf

    from qarl_cli.config.secrets import redact

    return redact(OmegaConf.to_container(OmegaConf.structured(cfg)))


def _step(line: str) -> Optional[int]:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # a line cut by a kill mid-write


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
