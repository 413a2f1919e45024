"""The tiny models' character-level tokenizer, saved as a real Hugging Face tokenizer (with a chat template), so
that transformers and vLLM load it offline with `AutoTokenizer.from_pretrained(dir)` like any other."""

from __future__ import annotations

import re
import string
from pathlib import Path

PAD, EOS, BOS_TURN, UNK = "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"
BOXED = "\\boxed{"  # one token: the answer format costs 1 token instead of 7 in a 12-token budget
# Role names are single tokens too: the chat template then costs 9 tokens per prompt instead of 24, which is
# most of the prompt at this size, and so most of the compute of every rollout and training step.
WORDS = (BOXED, "assistant", "system", "user")
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"

# Qwen-style ChatML; the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: Path):
    """Write the tokenizer files into out_dir and return the loaded PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, EOS, BOS_TURN, UNK]
    vocab = {tok: i for i, tok in enumerate([*specials, *WORDS, *CHARS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Every character is a token, except the WORDS, which are matched first.
    words = "|".join(re.escape(w) for w in WORDS)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"{words}|[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    core.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                  model_max_length=4096, padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))
    return tok
