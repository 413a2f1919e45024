"""Checks of a checkpoint's weight files before anything uses them, each failing in one line that names the file
or the tensor: a truncated or damaged safetensors file (its header does not cover the file), a shard the index
lists but that is missing, and weights holding NaN or inf (a diverged run's), which would otherwise be served,
evaluated (to 0 %) or trained on without a word.

    check_model_dir(path, what)     every file a run reads is there: config, tokenizer, weights (resolving it)
    load_model(path, dtype=...)     the Hugging Face model, its files and its weights checked (train, resume)
    check_checkpoint(path)          every tensor of every shard, streamed (eval)
    read_tensors(file)              one shard's tensors, one at a time, each checked (the quantize writer)
    require_finite(items, what)     in-memory weights (a checkpoint about to be written)"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from qarl_cli.models.safetensors_files import (CheckpointError, is_finite, open_safetensors, read_tensors,  # noqa: F401
                                        weight_files)


def nonfinite(items: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, list[str]]:
    """(how many floating-point tensors, the names of those holding NaN or inf)."""
    total, bad = 0, []
    for name, tensor in items:
        if tensor.dtype.is_floating_point:
            total += 1
            if not is_finite(tensor):
                bad.append(name)
    return total, bad


def require_finite(items: Iterable[tuple[str, torch.Tensor]], what: str, hint: str = "") -> None:
    """CheckpointError "{what}: N of M weight tensors hold NaN or inf (first: NAME){hint}" unless all are
    finite."""
    total, bad = nonfinite(items)
    if bad:
        raise CheckpointError(f"{what}: {len(bad)} of {total} weight tensors hold NaN or inf (first: {bad[0]})"
                              f"{hint}")


def check_files(path: Path) -> None:
    """Every shard of `path` is present and complete (headers only: no tensor is read)."""
    for file in weight_files(path):
        with open_safetensors(file):
            pass


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def training_checkpoint_model(path: Path) -> Path | None:
    """`path/model` when `path` is a training checkpoint (checkpoints/step_N/: model/ beside trainer.pt) rather
    than the Hugging Face checkpoint inside it, which is what model.path takes."""
    inner = Path(path) / "model"
    return inner if (Path(path) / "trainer.pt").is_file() and (inner / "config.json").is_file() else None


def check_model_dir(path: Path, what: str) -> Path:
    """`path` unchanged, or ConfigError "{what}: ..." naming the directory and the first file a run would miss:
    config.json (present, a JSON object), a tokenizer (one of TOKENIZER_FILES, readable JSON) and safetensors
    weights (every shard complete). Checked when the directory is resolved, before any model or engine loads,
    so a missing file is one line here rather than a loader's traceback later. `what`: the setting that named the
    directory (`model.path=...`, `resume=...`)."""
    import json

    from qarl_cli.config.errors import ConfigError

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"{what}: {path} is not a directory (a Hugging Face checkpoint directory is expected)")

    def read_json(name: str) -> Any:
        try:
            return json.loads((path / name).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"{what}: {path / name} cannot be read ({why}); copy or write it again") from None

    inner = training_checkpoint_model(path)
    if inner is not None:
        raise ConfigError(f"{what}: {path} is a training checkpoint; its model is {inner}: "
                          f"{what.split('=')[0]}={inner}")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{what}: no config.json in {path} (not a Hugging Face checkpoint directory)")
    if not isinstance(read_json("config.json"), dict):
        raise ConfigError(f"{what}: {path / 'config.json'} is not a model config (a JSON object)")
    present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not present:
        raise ConfigError(f"{what}: no tokenizer ({' or '.join(TOKENIZER_FILES)}) in {path}")
    for name in present:
        read_json(name)
    if not weight_files(path):
        raise ConfigError(f"{what}: no weights (model.safetensors, or model.safetensors.index.json and its "
                          f"shards) in {path}")
    check_files(path)  # the index's shards present and complete (headers only)
    return path


def check_checkpoint(path: Path) -> None:
    """Every shard complete and every tensor finite; CheckpointError naming the file or the first bad tensor."""
    check_files(path)
    total, bad = 0, []
    for file in weight_files(path):
        with open_safetensors(file) as reader:
            for key in reader.keys():
                t, b = nonfinite([(key, reader.get_tensor(key))])
                total, bad = total + t, bad + b
    if bad:
        raise CheckpointError(f"{path}: {len(bad)} of {total} weight tensors hold NaN or inf (first: {bad[0]}); "
                              "the checkpoint is unusable (a diverged run's?)")


def load_model(path: Path, **kwargs: Any) -> torch.nn.Module:
    """AutoModelForCausalLM.from_pretrained(path, **kwargs) after checking its files, and its weights after
    loading (in memory: no second read)."""
    from transformers import AutoModelForCausalLM

    check_files(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    require_finite(model.state_dict().items(), str(path), "; the checkpoint is unusable (a diverged run's?)")
    return model
