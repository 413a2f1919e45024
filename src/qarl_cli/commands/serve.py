"""`qarl serve model=... quant=... rollout.host=ADDR rollout.base_port=PORT rollout.api_key=KEY
rollout.transfer_backend=qarl_gloo|nccl`: one vLLM server on this node for a `qarl train` on another to attach to
(`rollout.urls=[http://ADDR:PORT]`, the same key and transfer backend). It serves what the run's own servers would:
the run's low-bit checkpoint (written into this run directory, as `qarl quantize` writes it), with qarl's key
guard, its weight-transfer backends and the run's dtype and seed, on `rollout.devices[0]` with the rollout's TP/EP
and memory settings. The int8 weight range follows the device kind, so the server and the trainer must share it.

It stays in the foreground until the server exits, Ctrl-C or SIGTERM, and then stops the server's processes.
Without rollout.api_key (or QARL_SERVER_KEY) a key is generated and written, readable by this user only, to
`server.key` in the run directory: a server that replaces weights never runs without one."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from qarl_cli.config.root import ServeConfig


def run(cfg: ServeConfig, run_dir: Path) -> int:
    import torch

    from qarl_cli.models.resolve import model_dir
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.checkpoint import write_checkpoint
    from qarl_cli.rollout.server_auth import KEY_ENV
    from qarl_cli.rollout.server_process import Server, _free_port
    from qarl_cli.rollout.routing import resolve_routing
    from qarl_cli.rollout.server_launch import server_command

    from qarl_cli.machine.capabilities import require_served

    rollout = cfg.rollout
    dtype = require_served(cfg).dtype or cfg.model.dtype  # W4A16 on CPU: the kernel's bf16 or fp16
    src = model_dir(cfg.model)
    scheme = build_scheme(cfg.quant, cfg.device)
    served = src
    if scheme.quantizes_weights:
        served = run_dir / "checkpoint"
        write_checkpoint(src, served, scheme, overwrite=True, progress=False,
                         trust_remote_code=cfg.model.trust_remote_code)
    key, where = rollout.api_key or os.environ.get(KEY_ENV), "given"
    if not key:
        key, where = secrets.token_urlsafe(24), str(run_dir / "server.key")
        fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
    port = rollout.base_port or _free_port(rollout.host)
    on_gpu = torch.cuda.is_available() and cfg.device != "cpu"
    from qarl_cli.rollout.server_check import identity

    cmd, env = server_command(rollout, served, port, key, dtype=dtype, seed=cfg.seed,
                              max_model_len=rollout.max_model_len, on_gpu=on_gpu,
                              identity=identity(src, served, scheme.name),
                              routing=resolve_routing(rollout, src, "qarl serve")[0])
    url = f"http://{rollout.host}:{port}"
    server = Server(0, url, key, cmd, env, run_dir / "server.log", rollout.request_timeout_s)
    try:
        server.start(rollout.startup_timeout_s)
        print(f"[qarl] serving {served} (quant={scheme.name}, {dtype}) at {url}, key {where}; attach with "
              f"rollout.urls=[{url}] rollout.transfer_backend={rollout.transfer_backend}; log {server.log}",
              flush=True)
        while server.alive():
            time.sleep(0.5)
        print(f"[qarl] the server exited with code {server.proc.returncode}; the last lines of {server.log}:\n"
              f"{server.tail()}")
        return 1
    finally:
        server.stop()
