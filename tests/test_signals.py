"""qarl_cli.machine.signals: what a signal does to a qarl process, whatever the process was started with."""

import os
import signal

import pytest

from qarl_cli.machine import signals


@pytest.fixture
def restore_handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, *signals.SIGNALS)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)
    signals._received.clear()


def test_sigint_is_armed_even_when_the_process_started_with_it_ignored(restore_handlers):
    """A non-interactive shell starts background jobs with SIGINT ignored; Python keeps it so, and before
    install() armed it a run ignored `kill -INT` to its last step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: stays ignored
    assert signals.install()
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        signal.sigtimedwait([], 0)  # a bytecode boundary for the handler to run at
    assert signals.received() == signal.SIGINT


def test_a_swallowed_interrupt_is_raised_again_by_check(restore_handlers):
    signals.install()
    signals.check()  # nothing received: a no-op
    try:
        os.kill(os.getpid(), signal.SIGINT)
        signal.sigtimedwait([], 0)
    except KeyboardInterrupt:
        pass  # swallowed, as a finalizer or a library callback would
    with pytest.raises(KeyboardInterrupt):
        signals.check()


def test_sigterm_becomes_terminated_with_the_shells_exit_code(restore_handlers):
    signals.install()
    with pytest.raises(signals.Terminated) as e:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)
    assert e.value.code == 128 + signal.SIGTERM
    with pytest.raises(signals.Terminated):
        signals.check()
