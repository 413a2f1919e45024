"""The trainer <-> server group of the `qarl_gloo` weight-transfer backend, both ends of it.

A group is one trainer (rank 0, the only sender) and the workers of one vLLM server (ranks 1..world-1), formed
through a TCPStore the trainer opens on `rollout.transfer_host`: a gloo group over TCP, so it reaches servers on
other nodes, on any machine (vLLM's nccl backend is the same shape on GPUs: vllm.distributed.weight_transfer).
The group lives outside torch.distributed's global state (a trainer under torchrun has its own), so tensors go
through the ProcessGroupGloo object itself, with group-local ranks.

The handshake: the trainer generates a secret per group and gives it to the server over the keyed HTTP route
(/init_weight_transfer_engine); once the group is formed, rank 0 broadcasts the secret's digest and the workers
compare it with theirs. Whoever opened the store at that port without the run's key cannot feed weights to a
server, and a server never loads from a rank 0 that cannot prove it is the trainer."""

from __future__ import annotations

import hashlib
import hmac
import socket
from datetime import timedelta
from typing import Any

import torch

PREFIX = "qarl-transfer"


def local_address(peer: str, port: int) -> str:
    """This machine's address on the route to `peer` (what a gloo device must bind for the peer to reach it)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:  # UDP connect sends nothing: it only picks the route
        s.connect((peer, port))
        return s.getsockname()[0]


def open_store(host: str, port: int, world_size: int, timeout_s: float, master: bool):
    """The group's TCPStore: the trainer opens it (port 0: a free one, read back from `.port`), workers join."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, world_size, is_master=master, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def open_group(store: Any, host: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """Join the gloo group whose store is `store` (on `host`); blocks until all `world_size` ranks have."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(PREFIX, store)
    if not hasattr(dist.ProcessGroupGloo, "_Options"):  # the public constructor: the hostname's address
        return dist.ProcessGroupGloo(prefixed, rank, world_size, timedelta(seconds=timeout_s))
    # gloo's default device is the address this host's name resolves to, which on a node with several networks
    # (or a hostname mapped to 127.0.1.1) is not always the one the trainer can reach: bind the one on the route
    # to the store instead (the options object is how torch's own init picks a device).
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address(host, store.port))]
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Rank 0's `tensor` into every rank's (same shape and dtype), as raw bytes: gloo need not know the dtype
    (float8, packed int4 in int32, bf16 all travel the same way)."""
    import torch.distributed as dist

    if tensor.numel() == 0:
        return
    flat = tensor.reshape(-1).view(torch.uint8)
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([flat], options).wait()
    if flat.data_ptr() != tensor.data_ptr():  # a non-contiguous receiver: reshape copied
        tensor.copy_(flat.view(tensor.dtype).reshape(tensor.shape))


def _digest(secret: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(secret.encode()).digest()), dtype=torch.uint8)


def prove(group: Any, secret: str) -> None:
    """Rank 0's side of the handshake."""
    broadcast(group, _digest(secret))


def check(group: Any, secret: str) -> None:
    """A worker's side: ValueError unless rank 0 holds the secret this worker was given."""
    got = torch.zeros(32, dtype=torch.uint8)
    broadcast(group, got)
    if not hmac.compare_digest(bytes(got.tolist()), bytes(_digest(secret).tolist())):
        raise ValueError("qarl_gloo: rank 0 of the transfer group did not prove the run's secret; its weights are "
                         "refused (another process holds the transfer port?)")
