"""One push's weights as bucket files: checked tensor by tensor (names, shapes, dtypes, finite values against what
the engine serves: rollout.weights) and written as safetensors files of at most `bucket_bytes` in host shared memory,
so the sender holds one bucket at a time, never the model, and a bad tensor stops the push before any server hears
of it. The files are what every transfer backend sends (sync.client.BucketSource)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import torch

from qarl_cli.rollout.base import WeightSyncError
from qarl_cli.sync.checksums import digest
from qarl_cli.rollout.weights import checked

FILE_PREFIX = "qarl-sync-"  # the only files a qarl_shm worker reads (sync.shm checks it)


def write_buckets(weights: Iterable[tuple[str, torch.Tensor]], spec, aliases, directory: Path, version: str,
                  bucket_bytes: int, engine: str, digests: Optional[dict] = None) -> tuple[list[Path], int]:
    """The checked weights as bucket files in `directory`; (paths, peak bytes held in one bucket). A bad tensor
    raises WeightSyncError before any server is touched (the files written so far are removed by the caller).
    digests: {name: dtype} of the tensors to hash as written (sync.checksums); replaced by {name: sha256}."""
    from safetensors.torch import save_file

    paths: list[Path] = []
    bucket: dict[str, torch.Tensor] = {}
    size = peak = 0

    def flush() -> None:
        nonlocal bucket, size
        if bucket:
            path = directory / f"{FILE_PREFIX}{version}-{len(paths):05d}.safetensors"
            save_file(bucket, str(path))
            paths.append(path)
        bucket, size = {}, 0

    # Tied pairs (alias -> the name the server stores it under): the alias is compared with its target once
    # both came, then dropped; the servers store the tensor once.
    targets: dict[str, torch.Tensor] = {}
    waiting: dict[str, torch.Tensor] = {}  # aliases that came before their target

    def same(alias: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if not torch.equal(a, b):
            raise WeightSyncError(f"{engine}: weight {alias!r} differs from {aliases[alias]!r}, which the served "
                                  "model ties it to (tie_word_embeddings); the engine kept its old weights")

    seen: set[str] = set()
    for name, tensor in weights:
        if name in seen:
            raise WeightSyncError(f"{engine}: weight {name!r} sent twice; the engine kept its old weights")
        seen.add(name)
        if name in aliases:
            if aliases[name] in targets:
                same(name, tensor, targets[aliases[name]])
            else:
                waiting[name] = tensor
            continue
        if name in aliases.values():
            targets[name] = tensor
            for alias in [a for a in waiting if aliases[a] == name]:
                same(alias, waiting.pop(alias), tensor)
        items = [(name, tensor)]
        for name, tensor in checked(items, spec, engine):
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > bucket_bytes:
                flush()
            bucket[name] = tensor.detach().cpu().contiguous()
            if digests is not None and name in digests:
                digests[name] = digest(bucket[name], digests[name])
            size += nbytes
            peak = max(peak, size)
    flush()
    for alias, tensor in waiting.items():  # its target never came: the server has no weight of that name
        checked([(alias, tensor)], spec, engine)
    return paths, peak


def engine_held(spec: dict, source: dict, served: dict, engine_dtype: torch.dtype) -> dict:
    """The dtypes a push sends. A float tensor the engine serves as it is in the source checkpoint (norms,
    embeddings, unquantized linears) is held in the dtype the engine runs in, not the one it was stored in:
    SmolLM2's checkpoint is bf16 and its engine fp32, and its fp32 masters cast to bf16 left the engine 0.02
    (mean |logprob|) from the trainer after every sync, on every scheme. The tensors a scheme writes (int8 weights
    and their fp32 scales, packed int4, fp8) go as the served checkpoint stores them, and the masters that
    sync.mode=online sends to be quantized keep their precision."""
    def held(name: str, dtype: torch.dtype) -> bool:
        kept = served.get(name, (None, torch.int8))[1]
        return name in source and dtype.is_floating_point and kept.is_floating_point and kept.itemsize > 1
    return {name: (shape, engine_dtype if held(name, dtype) else dtype) for name, (shape, dtype) in spec.items()}
