"""Rollout routing replay (R3) for mixture-of-experts models: the engine reports, for every token it ran, the
experts each MoE layer routed it to, and the learner's forward uses those experts instead of choosing its own.

Routing travels as one int16 tensor per sample, [tokens, layers, top_k]: row t is token position t of prompt +
response, from position 0 (vLLM's `routed_experts` with `routed_experts_prompt_start=0`), for every token the
engine ran, i.e. all but the last sampled one. Packed for the learner (train.sequences) it is [B, L, layers, top_k],
-1 where the engine reported nothing (padding, the last token): there the learner keeps its own choice.

The learner's side is a forward hook on each router (transformers' Qwen3-MoE `Qwen3MoeTopKRouter`, whose forward
returns router logits, top-k weights and top-k indices): it keeps the router's logits and replaces the indices by
the engine's and the weights by the learner's own softmax over all experts gathered at those indices, renormalised
when the config sets norm_topk_prob, as the router computes them for its own choice. So the experts are the
engine's while the router still gets gradients through the weights. The hook also records the router's own top-k,
from which the learner measures how often it agrees with the engine (qarl_cli.forward.routing_metrics)."""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from qarl_cli.config.errors import ConfigError

# A Qwen3-MoE router as transformers 5 names it: model.layers.{i}.mlp.gate (FSDP keeps the names).
_GATE = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")
ROUTERS = ("Qwen3MoeTopKRouter",)  # the router classes whose output contract the hook was written for
TRANSFORMERS_MAJOR = 5  # whose Qwen3MoeTopKRouter.forward returns (router_logits, top-k weights, top-k indices)
UNKNOWN = -1  # a token position the engine reported no routing for


def wanted(setting: Optional[bool], moe: bool, model: str) -> bool:
    """Whether routing replay is on: `rollout.routing_replay` (null: on exactly when the model has experts).
    true for a dense model is refused: there is no routing to replay."""
    if setting and not moe:
        raise ConfigError(f"rollout.routing_replay=true: model {model} is dense (it has no experts to route); "
                          "leave routing_replay null or set it false")
    return moe if setting is None else bool(setting)


def check_config(cfg) -> bool:
    """The config check of a run (before anything loads): wanted() for the configured model."""
    from qarl_cli.machine.capabilities import model_is_moe

    model = getattr(cfg.model, "path", None) or cfg.model.name
    return wanted(getattr(cfg.rollout, "routing_replay", None), model_is_moe(cfg.model), model)


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router module) of every MoE layer, by layer. A router of another kind than the hook
    was written for is refused in one line."""
    import transformers

    found = []
    for name, module in model.named_modules():
        match = _GATE.search(name)
        if match and not isinstance(module, nn.Linear) and hasattr(module, "top_k"):
            if type(module).__name__ not in ROUTERS:
                raise ConfigError(f"rollout.routing_replay: router {name} is a {type(module).__name__}; routing "
                                  f"replay supports {', '.join(ROUTERS)} (transformers 5's Qwen3-MoE); set "
                                  "rollout.routing_replay=false")
            if int(transformers.__version__.split(".")[0]) != TRANSFORMERS_MAJOR:
                raise ConfigError(f"rollout.routing_replay: the router hook was written for transformers "
                                  f"{TRANSFORMERS_MAJOR}'s router output (logits, weights, indices), this is "
                                  f"{transformers.__version__}; set rollout.routing_replay=false")
            found.append((int(match.group(1)), module))
    return sorted(found, key=lambda x: x[0])


def replayed_output(module: nn.Module, output: tuple, engine: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The router's (logits, weights, indices) with the engine's indices [tokens, k] (UNKNOWN rows: the router's
    own) and the weights recomputed from the router's logits at those indices."""
    logits, _, own = output
    engine = engine.to(own.device, torch.long)
    use = torch.where((engine >= 0).all(-1, keepdim=True), engine, own)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, use)
    if getattr(module, "norm_topk_prob", False):
        weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights.to(logits.dtype), use


@contextmanager
def replay(model: nn.Module, routed: Optional[Tensor], own: Optional[list] = None) -> Iterator[None]:
    """Forwards of `model` inside the block route each token as `routed` [B, L, layers, k] says (None: the model's
    own routing). `own`, when given, receives the router's own choice in the block's last forward, as [tokens,
    layers, k] int16 on the CPU (under replay that is the choice given the replayed layers below)."""
    pairs = routers(model) if routed is not None or own is not None else []  # a dense batch: no module walk
    if not pairs:
        yield
        return
    flat = routed.reshape(-1, *routed.shape[2:]) if routed is not None else None  # [B * L, layers, k]
    mine: dict[int, Tensor] = {}

    def hook(layer: int):
        def fn(module: nn.Module, args: tuple, output: tuple):
            mine[layer] = output[2].detach()
            if flat is None:
                return None
            if flat.shape[0] != output[2].shape[0]:
                raise ValueError(f"routing replay: {flat.shape[0]} routed tokens for a forward of {output[2].shape[0]}")
            return replayed_output(module, output, flat[:, layer])
        return fn

    handles = [module.register_forward_hook(hook(layer)) for layer, module in pairs]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    if own is not None and mine:
        own.append(torch.stack([mine[layer] for layer, _ in pairs], 1).to("cpu", torch.int16))


class Recorder:
    """The routing a model chooses, forward by forward (an engine's side): `take()` returns what the forwards since
    the last take routed, [tokens, layers, k] with tokens in the forward's flattened (batch-major) order."""

    def __init__(self, model: nn.Module) -> None:
        self.pairs = routers(model)
        self.layers = 1 + max((layer for layer, _ in self.pairs), default=-1)
        self._last: dict[int, Tensor] = {}
        self._handles = [m.register_forward_hook(self._hook(layer)) for layer, m in self.pairs]

    def _hook(self, layer: int):
        def fn(module: nn.Module, args: tuple, output: tuple) -> None:
            self._last[layer] = output[2].detach()
        return fn

    def take(self) -> Tensor:
        k = self.pairs[0][1].top_k
        tokens = next(iter(self._last.values())).shape[0]
        out = torch.full((tokens, self.layers, k), UNKNOWN, dtype=torch.int16)
        for layer, idx in self._last.items():
            out[:, layer] = idx.to("cpu", torch.int16)
        self._last.clear()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
