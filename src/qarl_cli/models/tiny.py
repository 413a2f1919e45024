"""Build, warm-start and cache the built-in tiny models (`model=tiny_arith`, `tiny_cot`, `tiny_sum`, `tiny_moe`).

A build writes into a temporary directory and renames it into place only when complete, then marks it with
BUILD_MARKER; a directory without the marker (a build killed mid-way, an old layout) is rebuilt. The cache key
hashes every field that changes the weights, so editing the recipe builds a new model beside the old one.

The default recipes of tiny_arith, tiny_moe and tiny_sum ship their builds with qarl (PREBUILT, a few MB each,
written by scripts/build_prebuilt.py): a warm start costs minutes on two cores (tiny_sum's 57 minutes here), and a
first run should not wait for one (tiny_cot, whose build takes tens of minutes, can ship the same way). A shipped
build
is copied into the cache only when its recipe is exactly the configured one (the same cache key);
`model.prebuilt=false` builds here instead, into a cache entry of its own. Builds differ between CPU kinds (their
float kernels round differently), so the shipped one also makes the default run the same on every kind."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from qarl_cli.config.model import TinyModelConfig

BUILD_MARKER = "qarl_build.json"
PREBUILT = Path(__file__).parent / "prebuilt"


def cache_path(cfg: TinyModelConfig) -> Path:
    # prebuilt=true leaves the key as it was before the option existed; false keys a build of this machine's own
    recipe = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("path", "cache_dir", "trust_remote_code") and not (k == "prebuilt" and v)}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:10]
    cache_dir = cfg.cache_dir
    if "${" in cache_dir:  # the schema's default, unresolved when the config was built in Python, not by Hydra
        from omegaconf import OmegaConf

        cache_dir = OmegaConf.create({"dir": cache_dir}).dir
    return Path(os.path.expanduser(cache_dir)) / f"{cfg.name}-{key}"


def is_complete(path: Path) -> bool:
    return (path / BUILD_MARKER).is_file() and (path / "config.json").is_file()


def ensure_tiny_model(cfg: TinyModelConfig, log: Callable[[str], None] = print) -> Path:
    """The checkpoint directory of a tiny model, built on first use and reused afterwards."""
    path = cache_path(cfg)
    if is_complete(path):
        return path
    if path.exists():
        log(f"[qarl] {path} is incomplete (an interrupted build?); rebuilding it")
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shipped = shipped_build(cfg)
    if shipped is not None:
        shutil.copytree(shipped, tmp)
        info = json.loads((shipped / BUILD_MARKER).read_text())
    else:
        start = time.time()
        info = build_tiny_model(cfg, tmp, log)
        info["build_seconds"] = round(time.time() - start, 1)
        (tmp / BUILD_MARKER).write_text(json.dumps(info, indent=2))
    try:
        tmp.rename(path)
    except OSError:  # another process finished the same build first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_complete(path):
            raise
    if shipped is not None:
        log(f"[qarl] {cfg.name}: the build shipped with qarl for this recipe ({_summary(info)}) -> {path}; "
            "model.prebuilt=false builds it here")
    else:
        log(f"[qarl] built {cfg.name} in {info['build_seconds']} s -> {path}")
    return path


def shipped_build(cfg: TinyModelConfig) -> Path | None:
    """The build shipped with qarl for exactly this recipe, if there is one and cfg.prebuilt allows it."""
    if not cfg.prebuilt:
        return None
    shipped = PREBUILT / cache_path(cfg).name
    return shipped if is_complete(shipped) else None


def _summary(info: dict) -> str:
    warm = info.get("warm_start") or {}
    acc = warm.get("heldout_accuracy")
    return ", ".join(filter(None, [f"{warm['steps']} warm-start steps" if warm else "",
                                   f"greedy {100 * acc:.1f} % held out" if acc is not None else "",
                                   f"built on {info['cpu']}" if info.get("cpu") else ""]))


def hf_config(cfg: TinyModelConfig, vocab_size: int, eos_id: int, pad_id: int):
    common = dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
                  eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None, rope_theta=10000.0,
                  torch_dtype=cfg.dtype)
    if cfg.num_experts:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
                              num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=True,
                              moe_intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=1)
    from transformers import Qwen3Config

    return Qwen3Config(**common, intermediate_size=cfg.intermediate_size)


def build_tiny_model(cfg: TinyModelConfig, out: Path, log: Callable[[str], None]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from qarl_cli.models.tokenizer import build_tokenizer
    from qarl_cli.models.warm_start import warm_start

    out.mkdir(parents=True)
    tok = build_tokenizer(out)
    torch.manual_seed(cfg.build_seed)
    config = hf_config(cfg, len(tok), tok.eos_token_id, tok.pad_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[qarl] building {cfg.name}: {type(model).__name__}, {n_params / 1e6:.2f}M parameters")
    from qarl_cli.machine.capabilities import cpu_kind

    recipe = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("path", "cache_dir", "prebuilt")}
    info = {"name": cfg.name, "parameters": n_params, "recipe": recipe, "cpu": cpu_kind(),
            "torch": torch.__version__}
    if cfg.warm_start_steps:
        info["warm_start"] = warm_start(model, tok, cfg, log)
    model.to(getattr(torch, cfg.dtype)).save_pretrained(str(out))
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=True,
                     temperature=1.0, top_p=1.0).save_pretrained(str(out))
    return info
