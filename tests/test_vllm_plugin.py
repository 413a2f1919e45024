"""qarl's vLLM plugin keeps vLLM's per-sync "RotaryEmbedding: Failed to load weights" (a success: the rotary cache is
put back as it was) off the console, and only that line, after vLLM re-applies its logging config as an engine
does when it starts (which used to undo the plugin's setting: the line showed on every step)."""

import logging


def test_only_the_rotary_reload_line_is_dropped_after_vllm_reconfigures_logging(capsys):
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    configure_logging(LoggingConfig())  # what an engine core does at start
    from vllm.model_executor.model_loader.reload import layerwise

    layerwise.logger.warning("%s: Failed to load weights", "RotaryEmbedding")
    layerwise.logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    for handler in logging.getLogger("vllm").handlers:
        handler.flush()
    out = capsys.readouterr()
    text = out.out + out.err
    assert "QKVParallelLinear: Failed to load weights" in text
    assert "RotaryEmbedding: Failed to load weights" not in text
