"""A Hugging Face checkpoint's safetensors files, read so that a damaged one fails in one line naming it: the shard
names (`INDEX`, `SINGLE`), which shards a directory has, a reader that refuses a truncated file, and tensors read
one at a time and checked to be finite. Shared by the checks of a checkpoint (models.integrity) and the writer of a
quantized one (quant.checkpoint), which import it and not each other."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from qarl_cli.config.errors import UserError

INDEX = "model.safetensors.index.json"  # a sharded checkpoint's weight map
SINGLE = "model.safetensors"  # an unsharded checkpoint's one file


class CheckpointError(UserError, ValueError):
    """A checkpoint whose files cannot be used: one line naming the file and what is wrong with it."""


def is_finite(tensor: torch.Tensor) -> bool:
    """True for a tensor with no NaN or inf (always for integer tensors)."""
    if not tensor.dtype.is_floating_point:
        return True
    return bool(torch.isfinite(tensor.float() if tensor.dtype.itemsize == 1 else tensor).all())


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
    path = Path(path)
    if (path / INDEX).is_file():
        import json

        try:
            names = json.loads((path / INDEX).read_text())["weight_map"].values()
        except (ValueError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{path / INDEX}: not a valid shard index ({type(e).__name__}: {e})") from None
        return [path / n for n in sorted(set(names))]
    return [path / SINGLE] if (path / SINGLE).is_file() else []
