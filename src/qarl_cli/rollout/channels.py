"""How one push's buckets reach one server: the data plane under rollout.transfer's RL-API sequence
(`rollout.transfer_backend`, which the servers start with).

- `qarl_shm`: the bucket files' paths (the server reads them; one node).
- `qarl_gloo`: the buckets' tensors broadcast over a gloo group (TCP) per server (rollout.transfer_group): any
  node, any machine.
- `nccl`: the same over vLLM's own nccl backend (vllm.distributed.weight_transfer.nccl_engine, dense, unpacked):
  GPUs, the trainer's and the server's on different devices (NCCL refuses two ranks on one GPU).

The buckets are files either way: they are what a failed push rolls every server back to (rollout.transfer), and
what a restarted server is brought up to date with. A network channel's group is per server, formed at the
server's first /init_weight_transfer_engine (and again after it restarts or a broadcast failed): rank 0 is this
process, the server's workers follow."""

from __future__ import annotations

import secrets
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

import torch


class Channel(Protocol):
    parallel: bool  # whether servers may be sent to from threads at once

    def init(self, server: Any, init_info: dict) -> None:
        """/init_weight_transfer_engine on `server` (forming its group, for a network channel)."""
        ...

    def send(self, server: Any, paths: list[Path], version: str) -> None:
        """The RL API's update sequence on one server: /pause, /start_weight_update, one /update_weights per
        bucket, /finish_weight_update with `version`, /resume (whatever failed)."""
        ...

    def close(self) -> None: ...


class ShmChannel:
    parallel = True

    def init(self, server: Any, init_info: dict) -> None:
        server.post("/init_weight_transfer_engine", {"init_info": init_info})

    def send(self, server: Any, paths: list[Path], version: str) -> None:
        _sequence(server, version, lambda: [server.post("/update_weights", {"update_info": {"path": str(p)}})
                                            for p in paths])

    def close(self) -> None:
        pass


def _sequence(server: Any, version: str, body) -> None:
    server.post("/pause", params={"mode": "wait"})
    try:
        server.post("/start_weight_update")
        body()
        server.post("/finish_weight_update", {"weight_version": version})
    finally:
        server.post("/resume")


class NetworkChannel:
    """qarl_gloo and nccl: per server a group with this process as rank 0; each bucket is announced by an
    /update_weights (names, dtypes, shapes) that the server answers once it has received and loaded what rank 0
    broadcast, so the request runs on a side thread while this one sends."""

    def __init__(self, backend: str, host: str, timeout_s: float) -> None:
        if backend == "nccl" and not torch.cuda.is_available():
            from qarl_cli.config.errors import UserError

            raise UserError("rollout.transfer_backend=nccl: this process sees no CUDA GPU (nccl moves weights "
                            "between GPUs); use qarl_gloo")
        self.backend, self.host, self.timeout_s = backend, host, timeout_s
        self.parallel = backend == "qarl_gloo"  # nccl: one stream, one group at a time
        self.groups: dict[int, Any] = {}
        self.init_info: dict = {}
        # nccl: the trainer's end of every group, on the GPU this process uses
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None

    def init(self, server: Any, init_info: dict) -> None:
        self.init_info = init_info
        self.groups.pop(server.index, None)
        # this rank and the server's workers (TP x PP x DP)
        world = 1 + int(server.get("/get_world_size")["world_size"])
        if self.backend == "qarl_gloo":
            from qarl_cli.rollout import transfer_group

            secret = secrets.token_hex(16)
            store = transfer_group.open_store(self.host, 0, world, self.timeout_s, master=True)
            info = {**init_info, "master_address": self.host, "master_port": store.port, "rank_offset": 1,
                    "world_size": world, "secret": secret, "timeout_s": self.timeout_s}

            def join():
                group = transfer_group.open_group(store, self.host, 0, world, self.timeout_s)
                transfer_group.prove(group, secret)
                return group, store  # the store lives as long as the group
        else:
            from vllm.distributed.weight_transfer.nccl_common import (NCCLWeightTransferInitInfo, trainer_init,
                                                                       worker_init_payload)

            from qarl_cli.rollout.server_process import _free_port

            port = _free_port(self.host)  # per group, chosen now: vLLM's nccl rendezvous has no handshake
            info = worker_init_payload(NCCLWeightTransferInitInfo(
                master_address=self.host, master_port=port, rank_offset=1, world_size=world, packed=False))

            def join():
                torch.cuda.set_device(self.device)
                return trainer_init({"master_address": self.host, "master_port": port, "world_size": world})
        try:
            self.groups[server.index] = self._with_request(server, "/init_weight_transfer_engine",
                                                           {"init_info": info}, join)
        except RuntimeError as e:
            if "init_weight_transfer_engine answered" not in str(e):
                raise
            from qarl_cli.config.errors import UserError

            raise UserError(f"rollout.transfer_backend={self.backend}: server {server.index} ({server.url}) refused "
                            f"the transfer group ({str(e).splitlines()[0]}); a server qarl did not start needs "
                            f"--weight-transfer-config '{{\"backend\":\"{self.backend}\"}}'") from None

    def send(self, server: Any, paths: list[Path], version: str) -> None:
        from safetensors.torch import load_file

        if server.index not in self.groups:  # first push after a broken group
            self.init(server, self.init_info)

        def buckets() -> None:
            for path in paths:
                tensors = load_file(str(path))
                meta = {"names": list(tensors), "dtype_names": [str(t.dtype).removeprefix("torch.")
                                                                for t in tensors.values()],
                        "shapes": [list(t.shape) for t in tensors.values()]}
                self._with_request(server, "/update_weights", {"update_info": meta},
                                   lambda: self._broadcast(server, list(tensors.values())))
        _sequence(server, version, buckets)

    def _broadcast(self, server: Any, tensors: list[torch.Tensor]) -> None:
        group = self.groups[server.index]
        if self.backend == "qarl_gloo":
            from qarl_cli.rollout import transfer_group

            for t in tensors:
                transfer_group.broadcast(group[0], t)
            return
        torch.cuda.set_device(self.device)
        stream = torch.cuda.current_stream()
        for t in tensors:  # the worker allocates each (shape, dtype) and receives it in this order
            group.broadcast(t.to(self.device), src=0, stream=stream)
        stream.synchronize()

    def _with_request(self, server: Any, path: str, body: dict, collective):
        """`path` posted to `server` (the server's part of a collective) and `collective` (this rank's part), on
        two threads; the collective's result. The first to fail raises at once and drops the group: the other
        end may be waiting in a collective that will never come (a gloo group gives up after
        transfer_timeout_s, which frees the thread left behind)."""
        pool = ThreadPoolExecutor(2)
        parts = [pool.submit(server.post, path, body), pool.submit(collective)]
        try:
            done, _ = wait(parts, return_when=FIRST_EXCEPTION)
            for part in done:
                part.result()  # raises the first failure
            parts[0].result()
            return parts[1].result()
        except BaseException:
            self.groups.pop(server.index, None)
            raise
        finally:
            pool.shutdown(wait=False)

    def close(self) -> None:
        self.groups.clear()


def channel_for(cfg: Any) -> Channel:
    """The channel of rollout config `cfg` (rollout=vllm, in-process: qarl_shm)."""
    backend = getattr(cfg, "transfer_backend", "qarl_shm")
    if backend == "qarl_shm":
        return ShmChannel()
    return NetworkChannel(backend, cfg.transfer_host, cfg.transfer_timeout_s)
