"""The `nccl` transfer backend: vLLM's own, both sides (vllm.distributed.weight_transfer.nccl_engine). The trainer
side is vLLM's NCCLTrainerWeightTransferEngine, built by its trainer factory from the init info below; the worker
side is vLLM's NCCLWeightTransferEngine, which a server started with `--weight-transfer-config
'{"backend":"nccl"}'` uses. Dense and unpacked, as qarl sends it: the bucket files' tensors, one broadcast each,
from this process's GPU (sync.client.BucketSource moves them there)."""

from __future__ import annotations


def trainer_init_info(host: str, world_size: int):
    """Rank 0's init info for a group of this process and `world_size - 1` server workers; the rendezvous port is
    chosen now, per group (vLLM's nccl rendezvous has no handshake to agree on one)."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    from qarl_cli.rollout.server_process import _free_port

    return NCCLTrainerInitInfo(master_address=host, master_port=_free_port(host), world_size=world_size,
                               packed=False, rank=0)
