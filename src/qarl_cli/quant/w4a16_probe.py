"""The W4A16 dtype probe's child (qarl_cli.machine.capabilities_probe starts it, one dtype per process, so that a SIGILL
takes the child): a one-layer random Qwen3 written as qarl's W4A16 vLLM checkpoint, loaded by vLLM in DTYPE, made to
generate four tokens. `python -m qarl_cli.quant.w4a16_probe DTYPE` exits 0 when that ran."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from qarl_cli.machine.capabilities_probe import ENGINE_ENV


def main(dtype: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qarl_cli.config.quant import W4A16Config
    from qarl_cli.quant import build_scheme
    from qarl_cli.quant.checkpoint import write_checkpoint

    os.environ.update(ENGINE_ENV)
    with tempfile.TemporaryDirectory(prefix="qarl-probe-") as tmp:
        src, served = Path(tmp) / "src", Path(tmp) / "w4a16"
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                             tie_word_embeddings=True, bos_token_id=None, eos_token_id=1, pad_token_id=0)
        Qwen3ForCausalLM(config).save_pretrained(str(src))
        write_checkpoint(src, served, build_scheme(W4A16Config(scale_dtype=dtype), "cpu"), progress=False)
        from vllm import LLM, SamplingParams

        llm = LLM(model=str(served), dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
                  kv_cache_memory_bytes=1 << 26, max_model_len=64)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                           SamplingParams(max_tokens=4, temperature=0.0, detokenize=False, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


if __name__ == "__main__":
    main(sys.argv[1])
