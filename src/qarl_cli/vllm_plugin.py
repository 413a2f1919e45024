"""qarl's vLLM general plugin (entry point `vllm.general_plugins: qarl`): vLLM loads it in every process it starts,
a `vllm serve` server and its workers included, so what qarl adds to vLLM is there wherever weights arrive.

It registers qarl's weight-transfer backends with vLLM's factory, `qarl_shm` (rollout.vllm_transfer: one node,
host shared memory) and `qarl_gloo` (rollout.vllm_transfer_gloo: TCP, any node), and on a CPU
installs the oneDNN int8 scale fix that backend's reloads need. Imports stay inside: vLLM loads plugins early."""

from __future__ import annotations


def register() -> None:
    import logging

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for backend, module, cls in (("qarl_shm", "qarl_cli.rollout.vllm_transfer", "QarlShmWeightTransferEngine"),
                                 ("qarl_gloo", "qarl_cli.rollout.vllm_transfer_gloo", "QarlGlooWeightTransferEngine")):
        if backend not in WeightTransferEngineFactory._registry:  # loaded once per process; be safe on a reload
            WeightTransferEngineFactory.register_engine(backend, module, cls)
    # Every reload warns "RotaryEmbedding: Failed to load weights": its cos/sin cache is not a checkpoint tensor
    # and is put back as it was, which is right. Keep the per-step log readable.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    from qarl_cli.rollout.vllm_transfer import install_cpu_fixes

    install_cpu_fixes()
