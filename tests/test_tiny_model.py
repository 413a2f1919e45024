"""The built-in tiny models: a real HF tokenizer, build-once caching, recovery from a killed build, and the
default model's starting accuracy (the acceptance range 20-60 % that leaves room for RL)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qarl_cli.config.model import TinyModelConfig, TinyMoEModelConfig
from qarl_cli.data import arith
from qarl_cli.models.tiny import BUILD_MARKER, cache_path, ensure_tiny_model
from qarl_cli.models.tokenizer import build_tokenizer


def test_tokenizer_is_a_real_hf_tokenizer(tmp_path):
    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))  # offline, from files only
    text = tok.apply_chat_template([{"role": "user", "content": "12+7"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n12+7<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("\\boxed{19}", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4  # "\boxed{" is one token, then "1", "9", "}"
    sample = "Solve: (3*x)^2 = 81, x >= 0? \\boxed{3}"
    assert tok.decode(tok(sample, add_special_tokens=False)["input_ids"]) == sample
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"


def _small(tmp_path, **kw):
    return TinyModelConfig(cache_dir=str(tmp_path), num_layers=1, warm_start_steps=2, warm_start_batch=4, **kw)


def test_build_once_then_reuse(tmp_path):
    cfg = _small(tmp_path)
    path = ensure_tiny_model(cfg, log=lambda _: None)
    stamp = (path / BUILD_MARKER).stat().st_mtime_ns
    assert ensure_tiny_model(cfg, log=lambda _: None) == path
    assert (path / BUILD_MARKER).stat().st_mtime_ns == stamp  # not rebuilt
    info = json.loads((path / BUILD_MARKER).read_text())
    assert info["warm_start"]["steps"] == 2
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.config.tie_word_embeddings
    assert cache_path(_small(tmp_path, build_seed=5)) != path  # another recipe, another directory


def test_incomplete_cache_is_rebuilt(tmp_path):
    cfg = _small(tmp_path)
    path = ensure_tiny_model(cfg, log=lambda _: None)
    (path / BUILD_MARKER).unlink()  # what an older, interrupted build left behind
    logs = []
    assert ensure_tiny_model(cfg, log=logs.append) == path
    assert (path / BUILD_MARKER).is_file() and any("incomplete" in m for m in logs)


def test_build_killed_midway_leaves_nothing_that_looks_complete(tmp_path):
    code = ("from qarl_cli.config.model import TinyModelConfig; from qarl_cli.models.tiny import ensure_tiny_model; "
            f"ensure_tiny_model(TinyModelConfig(cache_dir={str(tmp_path)!r}, num_layers=1, warm_start_steps=100000))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".tiny_arith-*.tmp-*")) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # inside the warm start now
    proc.kill()
    proc.wait()
    cfg = TinyModelConfig(cache_dir=str(tmp_path), num_layers=1, warm_start_steps=100000)
    assert not cache_path(cfg).exists()  # only the temporary directory was written
    small = _small(tmp_path)
    assert (ensure_tiny_model(small, log=lambda _: None) / BUILD_MARKER).is_file()


def test_tiny_moe_has_experts_and_a_router(tmp_path):
    cfg = TinyMoEModelConfig(cache_dir=str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model(cfg, log=lambda _: None)))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    names = {n for n, _ in model.named_modules()}
    assert "model.layers.0.mlp.gate" in names  # the router, kept in bf16 by every scheme


@pytest.fixture(scope="session")
def default_model():
    """The embedded default, built (or reused) in QARL_CACHE_DIR exactly as `qarl train` builds it."""
    cfg = TinyModelConfig(cache_dir=os.path.join(os.environ.get("QARL_CACHE_DIR", "~/.cache/qarl"), "models"))
    return ensure_tiny_model(cfg)


def _greedy_exact_match(path: Path, problems) -> float:
    """Greedy decoding one problem at a time (no padding), written here independently of the build's eval."""
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    hits = 0
    for p in problems:
        ids = tok.apply_chat_template([{"role": "user", "content": p.prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            for _ in range(12):
                nxt = model(input_ids=ids).logits[0, -1].argmax()
                if nxt.item() == tok.eos_token_id:
                    break
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        text = tok.decode(ids[0], skip_special_tokens=False).rsplit("assistant\n", 1)[1]
        hits += text == f"\\boxed{{{p.answer}}}"
    return hits / len(problems)


def test_default_model_starts_with_room_for_rl(default_model):
    problems = arith.test_split(150, [1, 2, 3])
    acc = _greedy_exact_match(default_model, problems)
    recorded = json.loads((default_model / BUILD_MARKER).read_text())["warm_start"]["accuracy"]
    print(f"tiny_arith greedy accuracy on 150 test problems: {acc:.1%} (build recorded {recorded:.1%} on 500)")
    assert 0.2 <= acc <= 0.6
