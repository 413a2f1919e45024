"""What a command may remove or replace, and how a full disk is named. Every command that removes, replaces or
rewrites a user's files (`quantize out=` with overwrite, a train run directory and its `overwrite=true`, resume's
tidying) asks here first, before it touches the disk:

- `refuse_overlap`: an output that is, contains or lies inside one of the command's inputs (also through a
  symbolic link on either side) is refused by name: replacing it would delete the input it is made from.
- `replaceable`: `overwrite=true` replaces a checkpoint directory, never a directory that holds anything else
  (a home directory, a clone, a run).
- `disk_full`: the forms in which the writers report a full file system (an OSError ENOSPC/EDQUOT,
  safetensors' error text, torch's zip writer's "unexpected pos"), so that it is named as such, not as a bug.

Torch-free: the config checks run it before anything loads."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterable, Optional

from qarl_cli.config.errors import ConfigError

FULL = (errno.ENOSPC, errno.EDQUOT)


def _forms(path: Path | str) -> set[Path]:
    """The path as written (made absolute) and as it resolves through symbolic links: either may be the one two
    paths share (a link to the input, or an input reached through a link)."""
    p = Path(os.path.expanduser(str(path)))
    return {Path(os.path.abspath(p)), p.resolve()}


def relation(a: Path | str, b: Path | str) -> Optional[str]:
    """How `a` stands to `b`: "is", "contains", "is inside", or None when neither holds the other."""
    for x in _forms(a):
        for y in _forms(b):
            if x == y:
                return "is"
            if x in y.parents:
                return "contains"
            if y in x.parents:
                return "is inside"
    return None


def refuse_overlap(key: str, path: Path | str, inputs: Iterable[tuple[str, Optional[Path | str]]], why: str) -> None:
    """ConfigError unless `path` (set by `key`) is apart from every (key, path) of `inputs` (None: not set)."""
    for other_key, other in inputs:
        if other is None or str(other) == "":
            continue
        how = relation(path, other)
        if how is not None:
            raise ConfigError(f"{key}={str(path)!r} {how} {other_key}={str(other)!r}: {why}")


def replaceable(key: str, path: Path) -> None:
    """ConfigError unless an existing `path` may be replaced by a checkpoint: a directory holding one (config.json
    and only plain files, as every checkpoint qarl writes). Anything else is not the kind of thing
    overwrite=true is for, and is kept."""
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_dir():
        raise ConfigError(f"{key}={str(path)!r} is a file, not a checkpoint directory; overwrite=true replaces "
                          "only a checkpoint directory: choose another path")
    subdirs = sorted(p.name for p in path.iterdir() if p.is_dir())
    if not (path / "config.json").is_file() or subdirs:
        what = f"holds directories ({', '.join(subdirs[:3])})" if subdirs else "holds no config.json"
        raise ConfigError(f"{key}={str(path)!r} is not a checkpoint directory (it {what}); overwrite=true "
                          "replaces only a checkpoint, so it is kept: choose another path")


def disk_full(e: BaseException) -> bool:
    """Whether `e` (or what it was raised from) reports a full file system or quota."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in FULL:
            return True
        text = str(e)
        if type(e).__name__ == "SafetensorError" and any(f"(os error {n})" in text for n in FULL):
            return True
        # torch.save's zip writer: a short write (the file system took fewer bytes than given) or a failed one
        if isinstance(e, RuntimeError) and ("unexpected pos" in text or "file write failed" in text):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
