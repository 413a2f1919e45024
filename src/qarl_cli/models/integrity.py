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

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch

from qarl_cli.config.errors import UserError


class CheckpointError(UserError, ValueError):
    """A checkpoint whose files cannot be used: one line naming the file and what is wrong with it."""


def is_finite(tensor: torch.Tensor) -> bool:
    """True for a tensor with no NaN or inf (always for integer tensors)."""
    if not tensor.dtype.is_floating_point:
        return True
    return bool(torch.isfinite(tensor.float() if tensor.dtype.itemsize == 1 else tensor).all())


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


@contextmanager
def open_safetensors(file: Path) -> Iterator[Any]:
    """safetensors' reader of `file`, or CheckpointError naming it (missing, truncated, not safetensors)."""
    from safetensors import safe_open

    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"{file}: missing (the checkpoint's index lists it)")
    try:
        reader = safe_open(str(file), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for every damaged file
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file}: not a complete safetensors file ({why}); it is truncated or damaged: "
                              "copy or write it again") from None
    with reader:
        yield reader


def read_tensors(file: Path, keys: Optional[list[str]] = None, what: str = ""
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """`file`'s tensors (`keys`, default all), one at a time, each checked for NaN/inf (CheckpointError naming
    the file and the tensor)."""
    with open_safetensors(file) as reader:
        for key in list(reader.keys()) if keys is None else keys:
            try:
                tensor = reader.get_tensor(key)
            except Exception as e:  # noqa: BLE001 - a file changed or damaged after its header was read
                raise CheckpointError(f"{file}: tensor {key!r} cannot be read ({str(e).splitlines()[0]}); the file "
                                      "is damaged") from None
            if not is_finite(tensor):
                raise CheckpointError(f"{what or file}: weight {key!r} holds NaN or inf values; the checkpoint is "
                                      "unusable (a diverged run's?)")
            yield key, tensor


def weight_files(path: Path) -> list[Path]:
    """The safetensors shards of checkpoint directory `path` (those its index lists, or model.safetensors;
    none for a checkpoint in another format)."""
    from qarl_cli.quant.checkpoint import INDEX, SINGLE

    path = Path(path)
    if (path / INDEX).is_file():
        import json

        try:
            names = json.loads((path / INDEX).read_text())["weight_map"].values()
        except (ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{path / INDEX}: not a valid shard index ({type(e).__name__}: {e})") from None
        return [path / n for n in sorted(set(names))]
    return [path / SINGLE] if (path / SINGLE).is_file() else []


def check_files(path: Path) -> None:
    """Every shard of `path` is present and complete (headers only: no tensor is read)."""
    for file in weight_files(path):
        with open_safetensors(file):
            pass


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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
