"""forward=aligned: the learner computes what the rollout engine computes. Every selected nn.Linear (and every
fused MoE expert matrix) is replaced by a module holding the *same* Parameter objects (so parameter names, the
optimizer's state and checkpoints are unchanged) whose forward uses the dequantized quantized weight Wq and, where
the scheme quantizes activations, the quantized-and-dequantized input. Gradients are straight-through: the
quantizers count as the identity in the backward, so d(loss)/d(W) = d(loss)/d(Wq) lands in the bf16 masters.
forward=bf16 leaves the model as it is (the naive quantized-rollout baseline).

Wq is cached per module, computed at the first forward after the masters change and reused by every forward
until then (rollout-logprob recomputation, the minibatches of a step). The cache key is each master's
`_version`, which every in-place write through the parameter bumps (optimizer.step, load_state_dict, copy_);
writes through `param.data` have a version counter of their own, so `refresh_after(optimizer, model)` also drops
the caches after every optimizer step, and `refresh(model)` drops them on demand.

Under FSDP (`keep_cache(model, False)`, set by train.distributed's shard) nothing is cached: a master is whole only
inside its layer's forward and backward (FSDP gathers it for each and frees it after), so a cache could never be
reused, and it would hold every layer's whole Wq on every rank, more than the rank's shard of the model. There Wq is
computed in each forward from the gathered master and recomputed in the backward from the master FSDP gathers
again, so no whole Wq outlives its layer's forward or backward."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qarl_cli.config.stages import ForwardConfig
from qarl_cli.quant.base import Scheme
from qarl_cli.quant.fp4 import group_amax, share_scales
from qarl_cli.quant.select import select_modules


class _StraightThrough(torch.autograd.Function):
    """Forward: `value` (the quantized tensor); backward: the gradient goes to `master` unchanged."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(master: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return _StraightThrough.apply(master, value) if master.requires_grad else value


def quant_act(scheme: Scheme, x: torch.Tensor) -> torch.Tensor:
    """x as the engine's GEMM sees it, with a straight-through gradient."""
    if not scheme.quantizes_activations:
        return x
    with torch.no_grad():
        value = scheme.fake_quant_act(x.detach())
    return straight_through(x, value)


def _version_key(params: list[torch.Tensor]) -> tuple:
    return tuple((p._version, p.data_ptr(), p.dtype) for p in params)


class _RecomputedLinear(torch.autograd.Function):
    """y = x_dq @ Wq^T, saving the master instead of Wq: the backward rebuilds Wq = rebuild(master) (the same
    quantization as the forward's) for the input's gradient; the weight's is straight-through, as in the fake path."""

    @staticmethod
    def forward(ctx: Any, x_dq: torch.Tensor, master: torch.Tensor, w_dq: torch.Tensor, rebuild: Any) -> torch.Tensor:
        ctx.rebuild = rebuild
        ctx.save_for_backward(x_dq, master)
        return F.linear(x_dq, w_dq)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x_dq, master = ctx.saved_tensors
        return *_linear_grads(ctx, grad, x_dq, lambda: ctx.rebuild(master.detach()), master.dtype), None, None


def _linear_grads(ctx: Any, grad: torch.Tensor, x_dq: torch.Tensor, w_dq: Any, dtype: torch.dtype) -> tuple:
    """(d/dx, d/dW) of y = x_dq @ Wq^T, the weight's straight through: d/dW = d/dWq. `w_dq()` gives Wq, built
    only when the input needs its gradient."""
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        with torch.no_grad():
            grad_x = grad @ w_dq().to(grad.dtype)
    if ctx.needs_input_grad[1]:
        grad_w = (grad.reshape(-1, grad.shape[-1]).t() @ x_dq.reshape(-1, x_dq.shape[-1])).to(dtype)
    return grad_x, grad_w


def _linear(x_dq: torch.Tensor, master: torch.Tensor, w_dq: torch.Tensor, keep: bool, rebuild: Any,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """x_dq @ Wq^T (+ bias) with a straight-through gradient into `master`; keep=False saves the master, not Wq."""
    if keep or not torch.is_grad_enabled() or not (x_dq.requires_grad or master.requires_grad):
        return F.linear(x_dq, straight_through(master, w_dq), bias)
    y = _RecomputedLinear.apply(x_dq, master, w_dq, rebuild)
    return y if bias is None else y + bias


class _Cached(nn.Module):
    """A module whose quantized weights are recomputed only when its master parameters change (keep=True), or in
    every forward and backward (keep=False: under FSDP, where the masters are whole only there)."""

    def __init__(self, scheme: Scheme) -> None:
        super().__init__()
        self.scheme = scheme
        self.keep = True
        self.quantizations = 0  # how often Wq was computed (tests: once per optimizer step)
        self._key: tuple | None = None
        self._value: Any = None

    def masters(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def compute(self) -> Any:
        raise NotImplementedError

    def refresh(self) -> None:
        self._key = self._value = None

    def load_quantized(self, value: Any) -> None:
        """Serve `value` (what `compute` returns) as it is: a rollout engine's prequantized weights, which
        no master holds. Pinned to the masters' current versions, so only a write to this module's masters (or
        `refresh`) replaces it; the masters themselves are left stale."""
        self._value = value
        self._key = _version_key(self.masters())

    def quantized(self) -> Any:
        if not self.keep:  # nothing held past this forward
            self._key = self._value = None
            self.quantizations += 1
            with torch.no_grad():
                return self.compute()
        key = _version_key(self.masters())
        if key != self._key:
            self._value = None  # free the stale copy before building the new one
            with torch.no_grad():
                self._value = self.compute()
            self._key = key
            self.quantizations += 1
        return self._value


class _LowbitLinear(torch.autograd.Function):
    """The engine's low-bit GEMM in the forward; the straight-through backward of the fake path."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, master: torch.Tensor, w_dq: torch.Tensor, packed: dict,
                scheme: Any, rebuild: Any) -> torch.Tensor:
        """rebuild: None to save Wq for the backward, else master -> Wq (the backward saves the master instead)."""
        ctx.rebuild = rebuild
        ctx.save_for_backward(scheme.fake_quant_act(x), w_dq if rebuild is None else master)
        return scheme.lowbit_matmul(x, packed, w_dq)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x_dq, w = ctx.saved_tensors
        w_dq = (lambda: w) if ctx.rebuild is None else lambda: ctx.rebuild(w.detach())
        return *_linear_grads(ctx, grad, x_dq, w_dq, w.dtype), None, None, None, None


class AlignedLinear(_Cached):
    def __init__(self, linear: nn.Linear, scheme: Scheme, lowbit: bool) -> None:
        super().__init__(scheme)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.lowbit = lowbit
        self.fused: tuple = ()  # the modules sharing a scale with this one (nvfp4's q/k/v, gate/up), itself included

    def masters(self) -> list[nn.Parameter]:  # a sibling's step changes this module's Wq too
        return [self.weight, *(m.weight for m in self.fused if m is not self)]

    def compute(self) -> tuple[dict, torch.Tensor]:
        return self._quantize(self.weight.detach())

    def _quantize(self, w: torch.Tensor) -> tuple[dict, torch.Tensor]:
        packed = self.scheme.quantize(w, amax=group_amax(w, self)) if self.fused else self.scheme.quantize(w)
        return packed, self.scheme.dequantize(packed, w.dtype)

    def packed(self) -> dict:
        """Wq in the scheme's checkpoint format, from the cache: the weight sync sends these, so Q(W) runs once
        per optimizer step for the sync and every forward until the next step."""
        return self.quantized()[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, w_dq = self.quantized()
        rebuild = lambda w: self._quantize(w)[1]  # noqa: E731 - Wq again from the master (keep=False's backward)
        if self.lowbit:
            if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
                y = _LowbitLinear.apply(x, self.weight, w_dq, packed, self.scheme, None if self.keep else rebuild)
            else:  # no backward: skip the dequantized input the backward would need
                y = self.scheme.lowbit_matmul(x, packed, w_dq)
            return y if self.bias is None else y + self.bias
        return _linear(quant_act(self.scheme, x), self.weight, w_dq, self.keep, rebuild, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, scheme={self.scheme.name}, lowbit={self.lowbit}"


class AlignedExperts(_Cached):
    """Fused MoE experts (transformers 5: gate_up_proj [E, 2I, H], down_proj [E, H, I]). Each expert's gate, up
    and down matrices are quantized on their own, as the checkpoint and vLLM hold them. The routing is the
    model's (the router is never quantized); tokens are quantized once before the gate/up GEMMs, as vLLM's fused
    MoE does. kernel=lowbit does not apply here (experts run the fake path)."""

    def __init__(self, experts: nn.Module, scheme: Scheme) -> None:
        super().__init__(scheme)
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.num_experts = experts.gate_up_proj.shape[0]
        self.act_fn = experts.act_fn

    def masters(self) -> list[nn.Parameter]:
        return [self.gate_up_proj, self.down_proj]

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._gate_up(self.gate_up_proj.detach()), self.scheme.fake_quant_weight(self.down_proj.detach())

    def _gate_up(self, gu: torch.Tensor) -> torch.Tensor:
        """gate and up of each expert ([..., 2I, H]) quantized as two matrices, as the checkpoint holds them; as one
        where they share a scale (nvfp4, whose blocks run along rows: only its global scale spans both)."""
        two_i, h = gu.shape[-2:]
        two = gu if getattr(self.scheme, "fused_group", None) else gu.reshape(*gu.shape[:-2], 2, two_i // 2, h)
        return self.scheme.fake_quant_weight(two).reshape(gu.shape)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        gate_up_q, down_q = self.quantized()
        if self.keep:
            gate_up = straight_through(self.gate_up_proj, gate_up_q)
            down = straight_through(self.down_proj, down_q)
        x = quant_act(self.scheme, hidden_states)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():  # experts with tokens (an expert-parallel index may point past the local ones)
            hit = [e for e in torch.unique(top_k_index).tolist() if e < self.num_experts]
        for e in hit:
            token, slot = torch.where(top_k_index == e)
            if self.keep:
                gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
                h = F.linear(quant_act(self.scheme, self.act_fn(gate) * up), down[e])
            else:  # each expert's matrices saved as masters and quantized again in the backward
                gate, up = _linear(x[token], self.gate_up_proj[e], gate_up_q[e], False, self._gate_up).chunk(2, dim=-1)
                h = _linear(quant_act(self.scheme, self.act_fn(gate) * up), self.down_proj[e], down_q[e], False,
                            self.scheme.fake_quant_weight)
            out.index_add_(0, token, (h * top_k_weights[token, slot, None]).to(out.dtype))
        return out


def align(model: nn.Module, scheme: Scheme) -> nn.Module:
    """Replace the selected modules of `model` in place (idempotent); returns the model."""
    lowbit = scheme.cfg.kernel == "lowbit"
    for target in select_modules(model, scheme.cfg.ignore) if scheme.quantizes_weights else []:
        if isinstance(target.module, _Cached):
            continue
        new = (AlignedLinear(target.module, scheme, lowbit) if target.kind == "linear"
               else AlignedExperts(target.module, scheme))
        parent, _, child = target.name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    share_scales(model, getattr(scheme, "fused_group", None))  # nvfp4: q/k/v and gate/up share a global scale
    return model


def refresh(model: nn.Module) -> None:
    """Drop every cached Wq of `model`: the next forward quantizes the masters again."""
    for m in model.modules():
        if isinstance(m, _Cached):
            m.refresh()


def keep_cache(model: nn.Module, keep: bool) -> None:
    """keep=False: every aligned module of `model` quantizes in each forward and backward and holds nothing past
    them (for a model whose masters are sharded between forwards: FSDP)."""
    for m in model.modules():
        if isinstance(m, _Cached):
            m.keep = keep
            m.refresh()


def refresh_after(optimizer: torch.optim.Optimizer, model: nn.Module) -> Any:
    """Drop the caches after every `optimizer.step()`, whatever the optimizer writes through. Returns the hook
    handle (`.remove()` detaches it)."""
    return optimizer.register_step_post_hook(lambda *_: refresh(model))


class AlignedForward:
    """forward=aligned: `apply(model)` puts the scheme's quantized modules into the policy."""

    def __init__(self, cfg: ForwardConfig, scheme: Scheme) -> None:
        self.cfg, self.scheme = cfg, scheme

    def apply(self, model: nn.Module) -> nn.Module:
        return align(model, self.scheme)


class BF16Forward(AlignedForward):
    """forward=bf16: the model as it is, whatever the rollout's scheme."""

    def apply(self, model: nn.Module) -> nn.Module:
        return model
