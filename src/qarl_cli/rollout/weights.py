"""What every engine checks before it touches its weights: each name is one the engine serves, each tensor has
the served shape and dtype and is finite. The engines own the check and the sync stage calls it: the torch engine
checks a push as a whole before loading any of it; a push to vLLM is checked tensor by tensor as its buckets are
written, before any engine hears of it (sync.buckets, which also drops tied aliases). Either way a bad tensor
anywhere leaves the engine as it was."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from qarl_cli.rollout.base import WeightSyncError

Spec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def spec_of(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) of checkpoint-format tensors."""
    return {name: (tuple(t.shape), t.dtype) for name, t in items}


def tied_aliases(model: torch.nn.Module, served: Iterable[str]) -> dict[str, str]:
    """alias -> name for the parameters `model` shares between names (tied embeddings: lm_head.weight is
    model.embed_tokens.weight) where the served checkpoint stores only `name`. `model` may be on the meta device."""
    served = set(served)
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            a, b = first[id(p)], name
            if a in served and b not in served:
                aliases[b] = a
            elif b in served and a not in served:
                aliases[a] = b
        else:
            first[id(p)] = name
    return aliases


def checked(weights: Iterable[tuple[str, torch.Tensor]], spec: Spec, engine: str
            ) -> list[tuple[str, torch.Tensor]]:
    """The weights as a list, each cast to the served dtype when both are floating point; WeightSyncError
    naming the first offending tensor otherwise. Nothing is loaded here."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[str] = set()
    for name, tensor in weights:
        if name not in spec:
            near = [k for k in spec if k.rsplit(".", 1)[0] == name.rsplit(".", 1)[0]]
            hint = f" (that module has {', '.join(sorted(near))})" if near else ""
            raise WeightSyncError(f"{engine}: unknown weight {name!r}{hint}; the engine kept its old weights")
        if name in seen:
            raise WeightSyncError(f"{engine}: weight {name!r} sent twice; the engine kept its old weights")
        seen.add(name)
        shape, dtype = spec[name]
        if tuple(tensor.shape) != shape:
            raise WeightSyncError(f"{engine}: weight {name!r} has shape {tuple(tensor.shape)}, the engine serves "
                                  f"{shape}; the engine kept its old weights")
        if tensor.dtype != dtype:
            if not (tensor.dtype.is_floating_point and dtype.is_floating_point):
                raise WeightSyncError(f"{engine}: weight {name!r} has dtype {tensor.dtype}, the engine serves "
                                      f"{dtype}; the engine kept its old weights")
            tensor = tensor.to(dtype)
        finite = torch.isfinite(tensor.float() if tensor.dtype.itemsize == 1 else tensor) \
            if tensor.dtype.is_floating_point else None
        if finite is not None and not bool(finite.all()):
            bad = int((~finite).sum())
            raise WeightSyncError(f"{engine}: weight {name!r} has {bad} NaN/inf values; the engine kept its "
                                  "old weights")
        out.append((name, tensor.detach()))
    return out
