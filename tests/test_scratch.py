"""The rollout engine's scratch copy of the served checkpoint (a real model's full quantized size, in /dev/shm) never
outlives its process: removed on close, when vLLM fails to start and on SIGTERM (qarl_cli.machine.signals), and after a
SIGKILL by the next engine's start-up sweep, which removes only the directories of dead processes.

The engines run in child processes (a real SIGTERM or SIGKILL needs its own process), each under its own
`workdir`, so nothing here touches another process's /dev/shm."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from qarl_cli.machine import scratch
from qarl_cli.config.model import TinyModelConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.rollout.vllm_engine import SCRATCH_PREFIX, _scratch_dir

ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("models"))
    return ensure_tiny_model(TinyModelConfig(cache_dir=cache, warm_start_steps=0), log=lambda _: None)


def _child(code: str, *args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=ENV,
                            stdout=subprocess.PIPE, text=True, **kwargs)


def _marked_line(child: subprocess.Popen) -> str:
    """The child's next line marked "@@ " (vLLM logs to stdout as well)."""
    for line in child.stdout:
        if line.startswith("@@ "):
            return line[3:].strip()
    return ""


def test_a_killed_process_s_scratch_is_removed_by_the_next_start_and_nothing_else(tmp_path):
    child = _child("""
        import os, signal, sys
        from pathlib import Path
        from qarl_cli.rollout.vllm_engine import _scratch_dir
        d = _scratch_dir(Path(sys.argv[1]))
        (d / "checkpoint").mkdir()
        (d / "checkpoint" / "model.safetensors").write_bytes(bytes(1000))
        print(d, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup can run
    """, tmp_path)
    left = child.stdout.readline().strip()
    assert child.wait() == -signal.SIGKILL
    assert os.path.isfile(os.path.join(left, "checkpoint", "model.safetensors"))  # what SIGKILL leaves

    tag = scratch.owner_tag()
    host, pid, start = tag.split("-")
    other_host = f"{(int(host, 16) + 1) % 16**6:06x}"
    keep = [tmp_path / f"{SCRATCH_PREFIX}abc123",  # not a tag (an older qarl's name): not ours to judge
            tmp_path / f"{SCRATCH_PREFIX}{other_host}-{child.pid}-1-x",  # another host's: its pids are not ours
            tmp_path / f"{SCRATCH_PREFIX}{tag}-livex",  # a live process's: this one
            tmp_path / "unrelated"]
    reused = tmp_path / f"{SCRATCH_PREFIX}{host}-{pid}-{int(start) + 1}-x"  # this pid, another (dead) process
    for d in [*keep, reused]:
        d.mkdir()
    mine = _scratch_dir(tmp_path)  # the next engine's start-up
    assert not os.path.exists(left) and not reused.exists()
    assert sorted(tmp_path.iterdir()) == sorted([*keep, mine])
    assert mine.name.startswith(f"{SCRATCH_PREFIX}{tag}-")


def test_owner_tags_name_a_process_exactly():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = scratch.owner_tag(child.pid)  # until it is waited for, a finished child is still in /proc
    child.wait()
    assert scratch.owner_alive(scratch.owner_tag())
    assert not dead.endswith("-0") and not scratch.owner_alive(dead)
    assert scratch.owner_alive("not-a-tag")


@pytest.mark.slow
def test_an_engine_that_fails_to_start_leaves_no_scratch(tiny, tmp_path):
    """vLLM refuses a max_model_len beyond the model's positions after the scratch checkpoint is written."""
    child = _child("""
        import sys
        from pathlib import Path
        from qarl_cli.config.quant import Int8Config
        from qarl_cli.config.stages import VLLMRolloutConfig
        from qarl_cli.quant import build_scheme
        from qarl_cli.rollout.vllm_engine import VLLMEngine
        try:
            VLLMEngine(VLLMRolloutConfig(max_model_len=10**7), Path(sys.argv[1]), build_scheme(Int8Config(), "cpu"),
                       dtype="float32", workdir=Path(sys.argv[2]))
        except Exception as e:
            print("@@ failed:", type(e).__name__, flush=True)
    """, tiny, tmp_path / "work")
    out, _ = child.communicate()
    assert child.returncode == 0 and "\n@@ failed: ValidationError\n" in out, out
    assert list((tmp_path / "work").iterdir()) == []


@pytest.mark.slow
def test_sigterm_ends_the_process_and_removes_the_engine_scratch(tiny, tmp_path):
    child = _child("""
        import sys, time
        from pathlib import Path
        from qarl_cli.machine import signals
        from qarl_cli.config.quant import Int8Config
        from qarl_cli.config.stages import VLLMRolloutConfig
        from qarl_cli.quant import build_scheme
        from qarl_cli.rollout.vllm_engine import VLLMEngine
        signals.install()
        engine = VLLMEngine(VLLMRolloutConfig(), Path(sys.argv[1]), build_scheme(Int8Config(), "cpu"),
                            dtype="float32", max_model_len=64, workdir=Path(sys.argv[2]))
        print("@@", engine.scratch, flush=True)
        while True:
            time.sleep(1)
    """, tiny, tmp_path / "work")
    served = _marked_line(child)
    assert served and os.path.isfile(os.path.join(served, "checkpoint", "model.safetensors"))
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=300) == 128 + signal.SIGTERM
    assert list((tmp_path / "work").iterdir()) == []


def test_signals_install_makes_sigterm_an_orderly_exit(tmp_path):
    """What install() gives any command: `finally` blocks and atexit hooks run, exit code 128 + 15."""
    child = _child("""
        import atexit, sys, time
        from pathlib import Path
        from qarl_cli.machine import signals
        signals.install()
        atexit.register(lambda: Path(sys.argv[1], "atexit").write_text("ran"))
        try:
            print("@@ ready", flush=True)
            while True:
                time.sleep(1)
        finally:
            Path(sys.argv[1], "finally").write_text("ran")
    """, tmp_path)
    assert _marked_line(child) == "ready"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit", "finally"]


def test_a_second_sigterm_while_unwinding_ends_the_process_at_once(tmp_path):
    child = _child("""
        import time
        from qarl_cli.machine import signals
        signals.install()
        try:
            print("@@ ready", flush=True)
            while True:
                time.sleep(1)
        finally:
            print("@@ cleaning", flush=True)
            while True:  # a cleanup that hangs
                time.sleep(1)
    """)
    assert _marked_line(child) == "ready"
    child.send_signal(signal.SIGTERM)
    assert _marked_line(child) == "cleaning"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
