"""The aligned forward: the quantized weight and activation in every selected layer (MoE experts included, each
expert matrix on its own), straight-through gradients into the masters, Wq cached once per optimizer step."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.model import TinyModelConfig, TinyMoEModelConfig
from qarl_cli.config.quant import SCHEMAS, Int8Config
from qarl_cli.config.stages import AlignedForwardConfig, BF16ForwardConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme
from qarl_cli.forward.aligned import AlignedExperts, AlignedLinear, align, refresh_after
from qarl_cli.quant.int8 import quantize_act_ref
from qarl_cli.quant.select import checkpoint_state
from qarl_cli.stages import resolve

SCHEMES = ["int8", "fp8_block", "w4a16", "nvfp4", "mxfp4"]


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory):
    return ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path_factory.mktemp("models")), warm_start_steps=0),
                             log=lambda _: None)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return ensure_tiny_model(TinyMoEModelConfig(cache_dir=str(tmp_path_factory.mktemp("models")), warm_start_steps=0),
                             log=lambda _: None)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def _linear(seed=0, n=192, k=256):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(k, n, bias=False))


@pytest.mark.parametrize("name", SCHEMES)
def test_linear_uses_quantized_weight_and_activation_with_straight_through_grads(name):
    scheme = build_scheme(SCHEMAS[name](), "cpu")
    model = _linear()
    w = model[0].weight
    align(model, scheme)
    assert isinstance(model[0], AlignedLinear) and model[0].weight is w
    x = torch.randn(5, 256, requires_grad=True)
    y = model(x)
    x_q, w_q = scheme.fake_quant_act(x.detach()), scheme.fake_quant_weight(w.detach())
    assert torch.equal(y, F.linear(x_q, w_q))
    if name != "w4a16":
        assert not torch.equal(x_q, x.detach())  # activations really are quantized
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(w.grad, g.t() @ x_q)  # d/dW = d/dWq (straight through)
    torch.testing.assert_close(x.grad, g @ w_q)


def test_int8_lowbit_is_the_engine_gemm_with_the_same_gradients():
    fake, low = _linear(), _linear()
    align(fake, build_scheme(Int8Config(), "cpu"))
    align(low, build_scheme(Int8Config(kernel="lowbit"), "cpu"))
    x = torch.randn(7, 256) * 3
    y = low(x)
    packed = low[0].quantized()[0]
    q, s = quantize_act_ref(x)
    expected = (torch._int_mm(q, packed["weight"].t()).float() * packed["weight_scale"].t()) * s
    assert torch.equal(y, expected)  # int32 accumulation, then weight scale, then token scale (oneDNN's epilogue)
    torch.testing.assert_close(y, fake(x), rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    fake(x).backward(g)
    torch.testing.assert_close(low[0].weight.grad, fake[0].weight.grad)


@pytest.mark.parametrize("name", SCHEMES)
def test_the_weight_sync_reuses_the_forwards_wq(dense_path, name):
    """quantized_state of an aligned model sends the cached Wq: after a step, the sync and every later forward
    quantize once in all, and what is sent equals quantizing the masters afresh (the unaligned model)."""
    from qarl_cli.quant.checkpoint import quantized_state

    scheme = build_scheme(SCHEMAS[name](), "cpu")
    plain = _load(dense_path)
    model = align(_load(dense_path), scheme)
    layers = [m for m in model.modules() if isinstance(m, AlignedLinear)]
    sent = dict(quantized_state(model, scheme))
    assert all(m.quantizations == 1 for m in layers)  # the sync computed Wq into the caches...
    model(torch.randint(3, 100, (2, 9)))
    assert all(m.quantizations == 1 for m in layers)  # ...and the forward used them
    fresh = dict(quantized_state(plain, scheme))
    assert sent.keys() == fresh.keys() and all(torch.equal(sent[k], fresh[k]) for k in fresh)


def test_wq_is_computed_once_per_optimizer_step(dense_path):
    model = _load(dense_path)
    align(model, build_scheme(Int8Config(), "cpu"))
    layers = [m for m in model.modules() if isinstance(m, AlignedLinear)]
    assert len(layers) == 28  # 4 layers x (q, k, v, o, gate, up, down); lm_head stays
    ids = torch.randint(3, 100, (2, 9))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):  # forwards within a step: old logprobs, then the minibatches
        with torch.no_grad():
            model(ids)
    assert all(m.quantizations == 1 for m in layers)
    model(ids).logits.mean().backward()
    opt.step()
    before = model(ids).logits
    model(ids)
    assert all(m.quantizations == 2 for m in layers)
    # A write through .data escapes the version counter; the optimizer hook drops the caches anyway.
    refresh_after(opt, model)
    for m in layers:
        m.weight.data.mul_(2)
    opt.zero_grad()
    opt.step()
    assert not torch.allclose(model(ids).logits, before)
    assert all(m.quantizations == 3 for m in layers)


def test_moe_experts_quantized_each_on_its_own_router_and_lm_head_kept(moe_path):
    scheme = build_scheme(SCHEMAS["fp8_block"](), "cpu")
    model = _load(moe_path)
    reference = checkpoint_state(model)  # per-expert matrices, as the checkpoint names them
    keys = set(model.state_dict())
    align(model, scheme)
    assert set(model.state_dict()) == keys  # names unchanged: optimizer state and checkpoints still fit
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts, AlignedExperts)
    assert not isinstance(mlp.gate, AlignedLinear) and isinstance(model.lm_head, nn.Linear)
    torch.manual_seed(0)
    h = torch.randn(11, 128)
    index = torch.randint(0, 4, (11, 2))
    weights = torch.rand(11, 2)
    out = mlp.experts(h, index, weights)
    # By hand: every expert matrix quantized alone (names from the checkpoint), tokens quantized per group.
    expected = torch.zeros_like(h)
    x = scheme.fake_quant_act(h)
    for t in range(11):
        for slot in range(2):
            e = index[t, slot].item()
            wq = {p: scheme.fake_quant_weight(reference[f"model.layers.0.mlp.experts.{e}.{p}.weight"])
                  for p in ("gate_proj", "up_proj", "down_proj")}
            a = F.silu(x[t] @ wq["gate_proj"].t()) * (x[t] @ wq["up_proj"].t())
            expected[t] += weights[t, slot] * (scheme.fake_quant_act(a[None])[0] @ wq["down_proj"].t())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    ids = torch.randint(3, 100, (2, 7))
    model(ids).logits.sum().backward()
    assert mlp.experts.gate_up_proj.grad is not None and mlp.experts.gate_up_proj.grad.abs().sum() > 0


def test_forward_stages_from_the_name_table(dense_path):
    scheme = resolve("quant", "int8")(Int8Config(), "cpu")
    model = _load(dense_path)
    assert resolve("forward", "bf16")(BF16ForwardConfig(), scheme).apply(model) is model
    assert not any(isinstance(m, AlignedLinear) for m in model.modules())
    resolve("forward", "aligned")(AlignedForwardConfig(), scheme).apply(model)
    assert isinstance(model.model.layers[0].self_attn.q_proj, AlignedLinear)
    align(model, scheme)  # idempotent
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, nn.Parameter)
    none = _load(dense_path)
    align(none, build_scheme(SCHEMAS["none"](), "cpu"))
    assert not any(isinstance(m, AlignedLinear) for m in none.modules())


def test_ignoring_only_some_expert_matrices_is_refused(moe_path):
    cfg = Int8Config(ignore=["lm_head", r".*\.mlp\.gate$", r"model\.layers\.0\.mlp\.experts\.1\.up_proj"])
    with pytest.raises(ConfigError, match="expert matrices"):
        align(_load(moe_path), build_scheme(cfg, "cpu"))
    cfg = Int8Config(ignore=["lm_head", r".*\.mlp\.gate$", r".*\.experts"])
    model = align(_load(moe_path), build_scheme(cfg, "cpu"))
    assert not any(isinstance(m, AlignedExperts) for m in model.modules())


def _saved_weight_copies(model, run):
    """Tensors autograd saves for the backward of `run()` that are a Wq (transposed or not) of one of the aligned
    modules and not a master: the quantized weights a backward would keep alive (what FSDP must not find
    after its reshard). Wq is recomputed here, by each module's own quantizer, before the forward."""
    wqs = []
    for m in model.modules():
        if isinstance(m, AlignedLinear):
            wqs.append(m.compute()[1])
        elif isinstance(m, AlignedExperts):
            wqs += [w[e] for w in m.compute() for e in range(w.shape[0])]
    copies = []

    def pack(t):
        if any(t.shape == w.shape and torch.equal(t, w) or t.shape == w.t().shape and torch.equal(t, w.t())
               for w in wqs):
            copies.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, copies


@pytest.mark.parametrize("name,kernel", [(n, "fake") for n in SCHEMES] + [("int8", "lowbit")])
def test_without_a_cache_the_forward_and_gradients_are_the_cached_ones_and_no_wq_is_kept(dense_path, name, kernel):
    """keep_cache(model, False) (what FSDP's shard sets): the same logits and master gradients as the cached
    forward, no module holds Wq after the forward, and the backward saves the masters, not copies of Wq (with
    the cache every linear saves its Wq, as autograd's matmul saves it, transposed: 28 of them)."""
    from qarl_cli.forward.aligned import keep_cache

    scheme = build_scheme(SCHEMAS[name](**({"kernel": kernel} if kernel != "fake" else {})), "cpu")
    ids = torch.randint(3, 100, (2, 9))
    grads, logits, copies = [], [], []
    for keep in (True, False):
        model = align(_load(dense_path), scheme)
        keep_cache(model, keep)
        out, saved = _saved_weight_copies(model, lambda: model(ids).logits)
        out.square().mean().backward()
        layers = [m for m in model.modules() if isinstance(m, AlignedLinear)]
        assert all((m._value is not None) == keep for m in layers)
        logits.append(out.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
        copies.append(saved)
    assert len(copies[0]) == 28 and copies[1] == []
    assert torch.equal(logits[0], logits[1])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)


def test_moe_experts_without_a_cache_give_the_cached_gradients(moe_path):
    from qarl_cli.forward.aligned import keep_cache

    scheme = build_scheme(SCHEMAS["fp8_block"](), "cpu")
    ids = torch.randint(3, 100, (2, 7))
    runs = []
    for keep in (True, False):
        model = align(_load(moe_path), scheme)
        keep_cache(model, keep)
        out, saved = _saved_weight_copies(model, lambda: model(ids).logits)
        out.square().mean().backward()
        experts = model.model.layers[0].mlp.experts
        runs.append((out.detach(), experts.gate_up_proj.grad, experts.down_proj.grad, saved))
    assert runs[0][3] and not runs[1][3]  # the cached forward saves Wq slices; without a cache none
    assert torch.equal(runs[0][0], runs[1][0])
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(runs[1][2], runs[0][2], rtol=1e-5, atol=1e-7)
