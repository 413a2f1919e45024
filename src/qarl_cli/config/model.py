"""Schema of the `model` group: which policy checkpoint to train, quantize or evaluate."""

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from qarl_cli.config.errors import require

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    name: str = MISSING  # option name (tiny_arith, tiny_moe, hf)
    # Hugging Face checkpoint directory (config.json, safetensors, tokenizer). Null for the built-in tiny
    # models, which are built on first use and cached under cache_dir; set it to use any checkpoint.
    path: Optional[str] = None
    # Master-weight dtype of the learner (and the rollout engine's unquantized dtype). bf16 for real models;
    # the tiny ones train in fp32 because this CPU has no bf16 matmul units.
    dtype: str = "bfloat16"
    # Where built models are cached (one sub-directory per model and build recipe).
    cache_dir: str = "${oc.env:QARL_CACHE_DIR,'~/.cache/qarl'}/models"
    trust_remote_code: bool = False  # passed to transformers for custom architectures

    def __post_init__(self) -> None:
        require(self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")


@dataclass
class HFModelConfig(ModelConfig):
    name: str = "hf"
    path: Optional[str] = MISSING  # required: there is nothing to build

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.path), "path", self.path, "model=hf needs model.path=DIR (a Hugging Face checkpoint)")


@dataclass
class TinyModelConfig(ModelConfig):
    """A Qwen3-architecture model small enough to build, train and serve on two CPU cores.
    Character-level tokenizer; built from these fields, then warm-started on arithmetic."""

    name: str = "tiny_arith"
    dtype: str = "float32"
    hidden_size: int = 128  # multiple of 128 so fp8 128x128 blocks and w4 groups of 128 tile it exactly
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # a head size vLLM's CPU attention supports
    intermediate_size: int = 384
    max_position_embeddings: int = 256
    # MoE shape (Qwen3-MoE); num_experts = 0 builds a dense Qwen3.
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    # Supervised warm start on generated arithmetic, so that RL starts from a model that is sometimes right
    # (greedy accuracy on the arith test split of roughly 20-60 %). 0 steps leaves the random init.
    warm_start_steps: int = 800
    warm_start_batch: int = 64
    warm_start_lr: float = 6e-3  # Muon for the hidden matrices, AdamW for the rest (qarl_cli.optim)
    # Where the warm start's cosine ends, as a fraction of warm_start_lr; 1.0 keeps the lr constant after warmup.
    # Not annealed on purpose: an annealed warm start (0.1) starts a few points higher, but then even supervised
    # training on gold answers gains only 5-7 points of avg@4 in 180 steps of 64, and RL as much; left at its full
    # lr, the model is still mid-descent and 180 RL steps gain 14 (measured: docs/learning.md).
    warm_start_final_lr: float = 1.0
    build_seed: int = 1234  # seed of init and warm start; part of the cache key

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.hidden_size == self.num_heads * self.head_dim, "hidden_size", self.hidden_size,
                f"must equal num_heads * head_dim = {self.num_heads * self.head_dim}")
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
                f"must divide num_heads={self.num_heads}")
        require(self.warm_start_steps >= 0, "warm_start_steps", self.warm_start_steps, "must be >= 0")
        require(0 <= self.warm_start_final_lr <= 1, "warm_start_final_lr", self.warm_start_final_lr,
                "must be in [0, 1]: a fraction of warm_start_lr")
        require(self.num_experts == 0 or self.num_experts >= self.num_experts_per_tok, "num_experts",
                self.num_experts, f"must be 0 (dense) or >= num_experts_per_tok={self.num_experts_per_tok}")


@dataclass
class TinyMoEModelConfig(TinyModelConfig):
    name: str = "tiny_moe"
    num_layers: int = 2
    num_experts: int = 4
    warm_start_steps: int = 0  # exercises MoE code paths; its accuracy does not matter


SCHEMAS = {"tiny_arith": TinyModelConfig, "tiny_moe": TinyMoEModelConfig, "hf": HFModelConfig}
