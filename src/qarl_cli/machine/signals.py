"""SIGTERM (and SIGHUP) as an orderly exit: by default Python dies of them at once, so no `finally`, context
manager or atexit hook runs, and whatever the process holds outside itself stays behind (the rollout engine's
scratch copy of the model in /dev/shm, a checkpoint's temporary directory). `install()` makes them raise
`Terminated` (a SystemExit) in the main thread instead, so the process unwinds as it does on an error and exits
with 128 + the signal's number, the shell's convention for a process ended by a signal.

SIGINT (Ctrl-C) raises KeyboardInterrupt, as Python's own handler does, but qarl installs it even when the process
was started with SIGINT ignored: a non-interactive shell starts every background job (`qarl train ... &`, a CI
script, `make test &`) with SIGINT ignored, Python then keeps it ignored, and a run went on for hundreds of steps
after `kill -INT` (the children of such a process, the test suite's runs included, inherit the same). A signal
whose exception some library swallowed (one raised inside a finalizer or a callback that ignores exceptions) is
raised again by `check()`, which the training loop calls at every stage boundary.

A second signal while the process unwinds takes the default action (the process dies at once: a user who asks
twice means it, and a process that caught the first one and went on must stay killable). SIGKILL cannot be
caught: what a killed process leaves is removed by the next one (qarl_cli.machine.scratch)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(SystemExit):
    """Raised in the main thread by a caught SIGTERM/SIGHUP; its code is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by {signal.Signals(self.signum).name}"


_received: list[int] = []


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _handler(signum: int, frame: Any) -> None:
    if _received:  # asked again while unwinding: die of the signal now
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)
    raise _exception(signum)


def install() -> bool:
    """Turn SIGTERM and SIGHUP into `Terminated` and SIGINT into KeyboardInterrupt in this process (idempotent;
    a process that handled one and went on, e.g. one running several commands, is armed again). Only the main
    thread can set signal handlers: from another thread this does nothing and returns False. SIGTERM and SIGHUP
    stay ignored when the process was started with them ignored (`nohup` ignores SIGHUP); SIGINT is always
    armed (see the module's docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _received.clear()
    for sig in SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _handler)
    signal.signal(signal.SIGINT, _handler)
    return True


def check() -> None:
    """Raise again the exception of a signal this process received and has not stopped for (its first
    exception was swallowed where it landed); a no-op otherwise."""
    if _received:
        raise _exception(_received[0])


def received() -> int | None:
    """The signal that ended the process, if one did."""
    return _received[0] if _received else None


def die_with_parent() -> None:
    """A child's preexec_fn (it runs between fork and exec): the kernel sends the child SIGTERM when the thread that
    forked it ends, so no process outlives the run that started it, SIGKILL of the run included."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
