"""How one push's buckets reach one server (`rollout.transfer_backend`, which the servers start with): per server one
trainer-side transfer engine, built by vLLM's `WeightTransferTrainerFactory` from the backend's init info.

- `qarl_shm` (sync.shm): the bucket files' paths; the server reads them (one node).
- `qarl_gloo` (sync.gloo): the buckets' tensors broadcast over a gloo group (TCP) per server: any node, any machine.
- `nccl` (sync.nccl): vLLM's own NCCL trainer engine (dense, unpacked): GPUs, the trainer's and the server's on
  different devices (NCCL refuses two ranks on one GPU).

A network backend's group is per server, formed at the server's first /init_weight_transfer_engine, and formed
again after the server restarts or a send through it failed (the other end may be waiting in a collective that
will never come): rank 0 is this process, the server's workers follow. qarl_shm holds no connection, so its engine
outlives a failed send. Around each round the server is paused (in-flight requests finish first); it is resumed
when the round succeeded. A failed round leaves it paused, for every client: the rollback's round resumes it, and a
server that cannot be put back stays paused (sync.transfer): half-loaded weights never serve a request."""

from __future__ import annotations

from typing import Any

from qarl_cli.config.errors import UserError

# backend -> (module, trainer engine class): the trainer sides qarl adds to vLLM's factory (nccl is vLLM's own)
TRAINER_ENGINES = {"qarl_shm": ("qarl_cli.sync.shm", "QarlShmTrainerEngine"),
                   "qarl_gloo": ("qarl_cli.sync.gloo", "QarlGlooTrainerEngine")}


def register_trainer_engines() -> None:
    """qarl's trainer sides in vLLM's WeightTransferTrainerFactory, once per process (the vLLM plugin registers
    them with the worker sides; a trainer talking to servers may never load the plugin, so the transport does too)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    for backend, (module, cls) in TRAINER_ENGINES.items():
        try:
            WeightTransferTrainerFactory.register_engine(backend, module, cls)
        except ValueError:  # already registered in this process
            pass


def trainer_init_info(backend: str, server: Any, online: dict, host: str, timeout_s: float):
    """The backend's TrainerInitInfo for `server` (rank 0: this process sends)."""
    if backend == "qarl_shm":
        from qarl_cli.sync.shm import QarlShmTrainerInitInfo

        return QarlShmTrainerInitInfo(rank=0, **online)
    world = 1 + int(server.get("/get_world_size")["world_size"])  # this rank and the server's workers
    if backend == "qarl_gloo":
        from qarl_cli.sync.gloo import QarlGlooTrainerInitInfo

        return QarlGlooTrainerInitInfo(rank=0, **online, host=host, world_size=world, timeout_s=timeout_s)
    from qarl_cli.sync.nccl import trainer_init_info as nccl_info

    return nccl_info(host, world)


class Transport:
    """The trainer side of one sync's pushes: per server a trainer engine (`init`), a paused round (`send`)."""

    def __init__(self, cfg: Any, online: dict) -> None:
        """cfg: the rollout config (rollout=vllm, in-process: qarl_shm); online: the worker's quantization for
        sync.mode=online ({} for prequantized)."""
        self.backend = getattr(cfg, "transfer_backend", "qarl_shm")
        if self.backend == "nccl":
            import torch

            if not torch.cuda.is_available():
                raise UserError("rollout.transfer_backend=nccl: this process sees no CUDA GPU (nccl moves weights "
                                "between GPUs); use qarl_gloo")
        self.host = getattr(cfg, "transfer_host", "127.0.0.1")
        self.timeout_s = getattr(cfg, "transfer_timeout_s", 120.0)
        self.online = online
        self.parallel = self.backend != "nccl"  # nccl: one stream, one group at a time
        self.device = None  # nccl: the trainer's end of every group, on the GPU this process uses
        self.engines: dict[int, Any] = {}
        if self.backend == "nccl":
            import torch

            self.device = torch.device("cuda", torch.cuda.current_device())
        register_trainer_engines()

    def init(self, server: Any) -> None:
        """/init_weight_transfer_engine on `server` through its new trainer engine (forming its group)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from qarl_cli.sync.client import BucketSource, ReceiverClient

        self.drop(server)
        info = trainer_init_info(self.backend, server, self.online, self.host, self.timeout_s)
        source = BucketSource(device=self.device)
        try:
            self.engines[server.index] = WeightTransferTrainerFactory.trainer_init(
                info, client=ReceiverClient(server), source=source)
        except RuntimeError as e:
            if self.backend == "qarl_shm" or "init_weight_transfer_engine answered" not in str(e):
                raise
            raise UserError(f"rollout.transfer_backend={self.backend}: server {server.index} ({server.url}) refused "
                            f"the transfer group ({str(e).splitlines()[0]}); a server qarl did not start needs "
                            f"--weight-transfer-config '{{\"backend\":\"{self.backend}\"}}'") from None

    def send(self, server: Any, paths: list, version: str) -> None:
        """The update round of `paths` on `server` as weight version `version`, between /pause and /resume."""
        if server.index not in self.engines:  # first push after a broken group
            self.init(server)
        engine = self.engines[server.index]
        engine.source.paths = list(paths)
        engine.client.version = version
        server.post("/pause", params={"mode": "wait"})
        try:
            engine.send_weights()
        except BaseException:
            if not getattr(engine, "stateless", False):
                self.drop(server)
            raise
        server.post("/resume")

    def drop(self, server: Any) -> None:
        engine = self.engines.pop(server.index, None)
        if engine is not None:
            engine.shutdown()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
        self.engines.clear()
