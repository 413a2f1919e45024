"""What a trainer-side transfer engine (vLLM's `TrainerWeightTransferEngine`) is handed: the weights to send, as
vLLM's `WeightSource`, and the engine's control plane, as vLLM's `VLLMWeightSyncClient`.

- `BucketSource`: one push's bucket files (sync.buckets), checked and written before any server hears of the
  push; the same files are what a rollback resends and a restarted server is brought up to date with. qarl_shm
  sends their paths; qarl_gloo and nccl broadcast their tensors, in file order.
- `ReceiverClient`: vLLM's HTTP weight-sync client with its requests sent through a receiver's `post`: a server's
  carries the run's key (rollout.server_auth) and names the server in its errors, which vLLM's own client (plain
  `requests.post`, no key) cannot do; the in-process engine's calls the LLM's RL methods (rollout.vllm_engine
  .LocalReceiver). It also carries the weight version that `finish_weight_update` reports, which vLLM's trainer
  engines do not pass."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient


class BucketSource(WeightSource):
    """The tensors of `paths` (safetensors bucket files), in file order; `paths` is set before each send."""

    def __init__(self, paths: Optional[list[Path]] = None, device: Optional[torch.device] = None) -> None:
        self.paths: list[Path] = list(paths or [])
        self.device = device  # where the tensors are yielded (nccl: this process's GPU); None: host memory

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, _DTYPES[dtype], tuple(shape)) for path in self.paths
                for name, dtype, shape in _header(path)]

    def buckets(self) -> Iterator[dict[str, torch.Tensor]]:
        """Each file's tensors, in the order metadata() lists them (the file's own)."""
        from safetensors import safe_open

        for path in self.paths:
            with safe_open(str(path), "pt") as f:
                yield {name: f.get_tensor(name) for name, _, _ in _header(path)}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            for name, tensor in bucket.items():
                yield name, tensor if self.device is None else tensor.to(self.device)


def _header(path: Path) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of a safetensors file's tensors in the order their bytes lie in the file (its header,
    read without the data: safetensors' own reader lists names sorted, not in file order)."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    ordered = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [(name, entry["dtype"], entry["shape"]) for name, entry in ordered]


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,  # safetensors'
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class ReceiverClient(HTTPVLLMWeightSyncClient):
    def __init__(self, receiver: Any) -> None:
        super().__init__(str(receiver.url))
        self.receiver = receiver
        self.version: Optional[str] = None  # what finish_weight_update reports when not told

    def _post(self, path: str, json: Optional[dict[str, Any]] = None) -> None:
        self.receiver.post("/" + path, json)

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        super().finish_weight_update(weight_version if weight_version is not None else self.version)
