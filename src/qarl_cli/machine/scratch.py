"""Scratch directories named after the process that owns them, so that what a killed process left behind (SIGKILL,
a crash, a power cut: no cleanup of its own can run) is found and removed by the next one, and nothing a live
process still uses is touched.

A name is `{prefix}{host}-{pid}-{start}-{random}`: `host` a short hash of the host name (a /dev/shm shared between
machines or containers sees other pid namespaces), `start` the process's start time in clock ticks since boot
(/proc/PID/stat), so a pid reused by an unrelated process does not keep a dead owner's directory alive."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Optional


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]


def _start_time(pid: int) -> Optional[str]:
    """The start time of process `pid` (field 22 of /proc/PID/stat), None where there is no such process; "0"
    where /proc is not available (then only whether the pid exists counts)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "0"
    except OSError:
        return "0"
    return stat.rsplit(")", 1)[1].split()[19]  # the command name (in parentheses) may hold spaces


def owner_tag(pid: Optional[int] = None) -> str:
    """`{host}-{pid}-{start}` of this process (or of `pid`)."""
    pid = os.getpid() if pid is None else pid
    return f"{_host()}-{pid}-{_start_time(pid) or '0'}"


_TAG = re.compile(r"^(?P<host>[0-9a-f]{6})-(?P<pid>\d+)-(?P<start>\d+)(?:-|$)")


def owner_alive(tag: str) -> bool:
    """Whether the process a tag (a name's part after the prefix) names still runs. Tags of another host, and
    names that are not tags at all, count as alive: they are not ours to remove."""
    m = _TAG.match(tag)
    if m is None or m["host"] != _host():
        return True
    start = _start_time(int(m["pid"]))
    return start is not None and (start == m["start"] or "0" in (start, m["start"]))


def make(parent: Path, prefix: str) -> Path:
    """A new directory `parent/{prefix}{tag}-{random}`, after removing those of `prefix` whose owner is dead."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    sweep(parent, prefix)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{owner_tag()}-", dir=parent))


def sweep(parent: Path, prefix: str) -> list[Path]:
    """Remove the entries `parent/{prefix}{tag}...` whose owner process is dead; returns them."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefix) and not owner_alive(entry.name[len(prefix):]):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


# ------------------------------------------------------------------------------------ renaming into place

_NOREPLACE, _EXCHANGE = 1, 2  # renameat2(2) flags (linux/fs.h)
_AT_FDCWD = -100


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """renameat2(src, dst, flags); False where the system or the file system does not offer it."""
    import ctypes
    import errno

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def publish(tmp: Path, out: Path, replace: bool = False) -> None:
    """Rename the finished directory `tmp` to `out` in one step. Without `replace` this fails with
    FileExistsError if `out` exists at that moment (whoever got there first keeps it: the check holds at the
    rename, not only when a writer started). With `replace` an existing `out` is swapped out atomically (never
    missing, never half-replaced) and then removed."""
    tmp, out = Path(tmp), Path(out)
    if not replace:
        if _renameat2(tmp, out, _NOREPLACE):
            return
        # Fallback: rename(2) of a directory onto a non-empty directory or onto a file fails.
        if out.exists() or out.is_symlink():
            raise FileExistsError(f"{out} exists")
        try:
            os.rename(tmp, out)
        except OSError as e:
            if out.exists():
                raise FileExistsError(f"{out} exists") from e
            raise
        return
    old = out.parent / f".{out.name}.old-{owner_tag()}"
    while True:
        try:
            if _renameat2(tmp, out, _EXCHANGE):  # `tmp` now holds the old output
                shutil.rmtree(tmp) if tmp.is_dir() and not tmp.is_symlink() else tmp.unlink()
                return
        except FileNotFoundError:  # no `out` to exchange with
            try:
                return publish(tmp, out, replace=False)
            except FileExistsError:
                continue  # created meanwhile: exchange with it
        break
    if out.exists() or out.is_symlink():  # fallback: move the old one aside, then rename into place
        os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
