"""A directory tree as it is on disk: every entry's relative name, kind, size and sha256 (a symbolic link: its
target, not followed). Taken before a command that must refuse or fail, and compared after: a refused command
leaves what exists exactly as it was. Used by the tests and by scripts/break_it.py."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def snapshot(root: Path | str) -> dict[str, tuple]:
    """{relative path: ("dir",) | ("link", target) | ("file", size, sha256)} for `root` and everything under it."""
    root = Path(root)
    out: dict[str, tuple] = {}
    if not (root.exists() or root.is_symlink()):
        return out
    if root.is_symlink() or root.is_file():
        return {".": _entry(root)}
    for base, dirs, files in os.walk(root):  # os.walk does not follow links to directories
        for name in dirs + files:
            path = Path(base) / name
            out[str(path.relative_to(root))] = _entry(path)
    return out


def _entry(path: Path) -> tuple:
    if path.is_symlink():
        return ("link", os.readlink(path))
    if path.is_dir():
        return ("dir",)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return ("file", path.stat().st_size, digest.hexdigest())


def changes(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What differs, one line per entry: "- gone", "+ new", "~ changed"."""
    lines = [f"- {k}" for k in sorted(before.keys() - after.keys())]
    lines += [f"+ {k}" for k in sorted(after.keys() - before.keys())]
    lines += [f"~ {k}" for k in sorted(before.keys() & after.keys()) if before[k] != after[k]]
    return lines


class Unchanged:
    """`with Unchanged(path, ...):` asserts, on leaving, that each tree is exactly as it was on entering."""

    def __init__(self, *roots: Path | str) -> None:
        self.roots = [Path(r) for r in roots]

    def __enter__(self) -> "Unchanged":
        self.before = [snapshot(r) for r in self.roots]
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            return
        for root, before in zip(self.roots, self.before):
            diff = changes(before, snapshot(root))
            assert not diff, f"{root} changed: {diff[:10]}"
