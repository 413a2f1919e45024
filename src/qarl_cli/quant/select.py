"""Which weights a scheme quantizes (docs/design.md): every nn.Linear and every fused MoE expert matrix, except the
layers whose names fully match one of `quant.ignore`'s regular expressions (by default lm_head and the MoE router
`mlp.gate`). Embeddings and norms are never quantized; the Qwen3-MoE router is not an nn.Linear in transformers 5
and is kept in any case.

transformers 5 holds a MoE layer's experts fused, `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], and saves
them per expert (`experts.{e}.gate_proj.weight`, ...), the names vLLM loads. Names here are module names
(`model.layers.0.self_attn.q_proj`); an expert matrix is named as in the checkpoint (`...experts.3.up_proj`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from qarl_cli.config.errors import ConfigError

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def is_ignored(name: str, ignore: Iterable[str]) -> bool:
    return any(re.fullmatch(p, name) for p in ignore)


def is_linear(module: nn.Module) -> bool:
    """nn.Linear, or a module standing in for one with the same weight (the aligned forward's AlignedLinear),
    so that an aligned model has the checkpoint plan of the model it was made from."""
    return isinstance(module, nn.Linear) or (
        hasattr(module, "in_features") and isinstance(getattr(module, "weight", None), nn.Parameter))


def is_fused_experts(module: nn.Module) -> bool:
    params = [getattr(module, n, None) for n in ("gate_up_proj", "down_proj")]
    return all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params)


def experts_selected(name: str, module: nn.Module, ignore: Iterable[str]) -> bool:
    """All of a fused experts module's matrices are quantized, or none (one fused kernel serves them all)."""
    if getattr(module, "is_transposed", False) or not getattr(module, "is_concatenated", True) \
            or not getattr(module, "has_gate", True) or getattr(module, "has_bias", False):
        raise ConfigError(f"{name}: only fused experts laid out as [gate; up] x [out, in] without bias "
                          "(Qwen3-MoE's) are supported")
    names = [f"{name}.{e}.{p}" for e in range(module.gate_up_proj.shape[0]) for p in EXPERT_PROJS]
    ignored = {is_ignored(n, ignore) for n in names} | {is_ignored(name, ignore)}
    if ignored == {True, False} and not is_ignored(name, ignore):
        raise ConfigError(f"quant.ignore leaves some of {name}'s expert matrices in bf16 but not all; "
                          f"ignore all of them (e.g. '{re.escape(name)}') or none")
    return True not in ignored


@dataclass(frozen=True)
class Target:
    name: str
    module: nn.Module
    kind: str  # "linear" or "experts"


def select_modules(model: nn.Module, ignore: Iterable[str]) -> list[Target]:
    """The modules of an in-memory model whose weights the scheme quantizes."""
    ignore = list(ignore)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and not is_ignored(name, ignore):
            out.append(Target(name, m, "linear"))
        elif is_fused_experts(m) and experts_selected(name, m, ignore):
            out.append(Target(name, m, "experts"))
    return out


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their checkpoint names (fused experts split per expert), as save_pretrained
    writes them; tied weights are kept (an engine reload needs lm_head even when it is tied)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, model.state_dict())


@dataclass(frozen=True)
class CheckpointPlan:
    quantized: frozenset  # checkpoint tensor names ("...q_proj.weight") the scheme replaces
    kept: tuple  # linear-like layers (2-D weights other than embeddings) left unquantized: the config's ignore


def checkpoint_plan(model: nn.Module, ignore: Iterable[str]) -> CheckpointPlan:
    """Plan for a model's checkpoint; `model` may live on the meta device (only names and shapes are read)."""
    ignore = list(ignore)
    modules = dict(model.named_modules())
    experts = {n: experts_selected(n, m, ignore) for n, m in modules.items() if is_fused_experts(m)}
    quantized, kept = set(), []
    for key, t in checkpoint_state(model).items():
        owner = key.removesuffix(".weight")
        if owner == key or t.dim() != 2 or isinstance(modules.get(owner), nn.Embedding):
            continue
        fused = next((p for p in experts if owner.startswith(p + ".")), None)
        if fused is not None and experts[fused]:
            quantized.add(key)
        elif fused is None and is_linear(modules.get(owner)) and not is_ignored(owner, ignore):
            quantized.add(key)
        else:
            kept.append(owner)
    return CheckpointPlan(frozenset(quantized), tuple(sorted(kept)))
