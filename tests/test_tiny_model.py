"""The built-in tiny models: a real HF tokenizer, build-once caching, recovery from a killed build, and the
default model's starting accuracy: inside the warm start's band (TinyModelConfig.warm_start_target_band), which
leaves room for RL, on any CPU (the band logic itself: test_warm_start.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from qarl_cli.config.model import TinyModelConfig, TinyMoEModelConfig
from qarl_cli.config.data import ArithDataConfig
from qarl_cli.models.tiny import BUILD_MARKER, cache_path, ensure_tiny_model
from qarl_cli.models.tokenizer import build_tokenizer
from qarl_cli.models.warm_start import heldout_split


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
    """Two warm-start steps and a band every accuracy is in: nothing to continue."""
    return TinyModelConfig(cache_dir=str(tmp_path), num_layers=1, warm_start_steps=2, warm_start_batch=4,
                           warm_start_target_band=[0.0, 1.0], warm_start_check_size=4, **kw)


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
    big = f"cache_dir={str(tmp_path)!r}, num_layers=1, warm_start_steps=100000, warm_start_max_steps=100000"
    code = ("import sys; from qarl_cli.config.model import TinyModelConfig; from qarl_cli.models.tiny import "
            f"ensure_tiny_model; ensure_tiny_model(TinyModelConfig({big}), "
            "log=lambda m: print(m, file=sys.stderr, flush=True))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    for line in proc.stderr:  # the build logs this line, then starts its 100000 warm-start steps
        if line.startswith("[qarl] building tiny_arith"):
            break
    else:
        pytest.fail(f"the build ended before its warm start (exit code {proc.wait()})")
    proc.kill()
    proc.wait()
    (partial,) = tmp_path.glob(".tiny_arith-*.tmp-*")
    assert (partial / "tokenizer.json").is_file() and not (partial / "model.safetensors").exists()
    cfg = TinyModelConfig(cache_dir=str(tmp_path), num_layers=1, warm_start_steps=100000,
                          warm_start_max_steps=100000)
    assert not cache_path(cfg).exists()  # only the temporary directory was written
    small = _small(tmp_path)
    assert (ensure_tiny_model(small, log=lambda _: None) / BUILD_MARKER).is_file()


def test_tiny_moe_has_experts_and_a_router(tmp_path):
    cfg = TinyMoEModelConfig(cache_dir=str(tmp_path), warm_start_steps=0)
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
        out_ids = []
        with torch.no_grad():  # transformers' own KV cache: one token per forward after the prompt
            out = model(input_ids=ids, use_cache=True)
            for _ in range(ArithDataConfig.max_new_tokens):
                nxt = out.logits[0, -1].argmax()
                if nxt.item() == tok.eos_token_id:
                    break
                out_ids.append(nxt.item())
                out = model(input_ids=nxt.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
        text = tok.decode(ids[0].tolist() + out_ids, skip_special_tokens=False).rsplit("assistant\n", 1)[1]
        hits += text == f"\\boxed{{{p.answer}}}"
    return hits / len(problems)


def test_default_model_starts_inside_its_band(default_model):
    """What the build recorded is what the model does, and it is inside the band the recipe asks for: the held-out
    accuracy, measured again here by an independent decoder, and the test split's as the build measured it, up to
    its sampling error (3 standard errors). No CPU's own numbers: the band is the recipe's."""
    cfg = TinyModelConfig()
    lo, hi = cfg.warm_start_target_band
    info = json.loads((default_model / BUILD_MARKER).read_text())["warm_start"]
    assert info["in_band"] and lo <= info["heldout_accuracy"] <= hi
    assert cfg.warm_start_steps <= info["steps"] <= cfg.warm_start_max_steps
    assert info["checks"][0]["steps"] == cfg.warm_start_steps and info["checks"][-1]["steps"] == info["steps"]
    held = _greedy_exact_match(default_model, heldout_split(cfg.warm_start_check_size))
    test = info["accuracy"]  # the build's own (batched) measurement of the test split
    print(f"tiny_arith after {info['steps']} warm-start steps: greedy {held:.1%} held out (build recorded "
          f"{info['heldout_accuracy']:.1%}), {test:.1%} on the test split")
    assert held == pytest.approx(info["heldout_accuracy"], abs=0.02)  # batched vs one at a time: a few flips
    error = 3 * (test * (1 - test) / ArithDataConfig.test_size) ** 0.5
    assert lo - error <= test <= hi + error


@pytest.mark.parametrize("name", ["tiny_arith", "tiny_moe", "tiny_sum"])
def test_each_default_recipe_ships_its_build(name):
    """A first run copies the shipped build instead of a warm start of minutes: each default recipe has one under
    its own cache key, recorded with that recipe, complete, and loadable as the architecture the recipe asks for.
    A recipe edited without scripts/build_prebuilt.py has no shipped build (its key changed): this fails."""
    import dataclasses

    from qarl_cli.config.model import SCHEMAS
    from qarl_cli.models.tiny import shipped_build

    cfg = SCHEMAS[name]()
    shipped = shipped_build(cfg)
    assert shipped is not None, f"no shipped build for {name}'s recipe ({cache_path(cfg).name}): run " \
                                "scripts/build_prebuilt.py"
    info = json.loads((shipped / BUILD_MARKER).read_text())
    recipe = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("path", "cache_dir", "prebuilt")}
    assert info["recipe"] == json.loads(json.dumps(recipe))
    assert info["warm_start"]["in_band"]
    config = AutoConfig.from_pretrained(str(shipped))  # transformers 5 stores Qwen3-MoE's experts as num_local_experts
    assert config.num_hidden_layers == cfg.num_layers
    assert (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0) or 0) == cfg.num_experts
    assert shipped_build(dataclasses.replace(cfg, prebuilt=False)) is None


def test_a_first_use_copies_the_shipped_build_and_prebuilt_false_keys_its_own(tmp_path):
    cfg = TinyModelConfig(cache_dir=str(tmp_path))
    logs = []
    path = ensure_tiny_model(cfg, log=logs.append)
    assert path.parent == tmp_path and "shipped with qarl" in logs[0] and "prebuilt=false" in logs[0]
    from qarl_cli.models.tiny import PREBUILT

    for f in (PREBUILT / path.name).iterdir():  # the same files, byte for byte
        assert (path / f.name).read_bytes() == f.read_bytes()
    import dataclasses

    own = cache_path(dataclasses.replace(cfg, prebuilt=False))
    assert own != path and own.parent == tmp_path  # a build of this machine's own would not replace the copy
