"""Rollout routing replay (R3) for MoE: the engine reports the experts it routed each token to, the learner's
forward routes every token to those experts with gate weights recomputed from its own router (qarl_cli.forward.routing).

References are computed here by hand: the MoE layer from its weights and given expert indices, the engine's routing
from transformers' own `output_router_logits`, the agreement metric from a hand-made example."""

import types

import pytest
import torch
import torch.nn.functional as F

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.model import TinyModelConfig, TinyMoEModelConfig
from qarl_cli.config.quant import Int8Config, NoQuantConfig
from qarl_cli.config.stages import TorchRolloutConfig
from qarl_cli.forward.routing_metrics import routing_agreement
from qarl_cli.forward.routing import check_config, replay, wanted


def _moe_model(seed=0, layers=1):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, intermediate_size=32, moe_intermediate_size=8,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # transformers initialises the router at zero: every expert would tie
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 1.0)
    return model


def _block_io(model):
    """The MoE block's input and output of the next forward (layer 0)."""
    seen = {}
    block = model.model.layers[0].mlp
    h1 = block.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    h2 = block.register_forward_hook(lambda m, a, o: seen.__setitem__("y", o))
    return seen, (h1, h2)


def _by_hand(block, x, idx, gate_weight):
    """Qwen3-MoE's sparse block with the experts `idx` [T, k] given: softmax over all experts of x W_g^T, the
    chosen ones' probabilities renormalised, each chosen expert's SwiGLU output weighted by them."""
    x = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(x @ gate_weight.T, -1)
    w = probs.gather(-1, idx)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    e = block.experts
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            gate, up = (e.gate_up_proj[idx[t, j]] @ x[t]).chunk(2)
            out[t] += w[t, j] * (e.down_proj[idx[t, j]] @ (F.silu(gate) * up))
    return out


def _bottom2(model, ids):
    """For each token of layer 0, the two experts the router likes least: never its own choice."""
    with torch.no_grad():
        seen, hooks = _block_io(model)
        model(input_ids=ids)
        for h in hooks:
            h.remove()
        logits = seen["x"].reshape(-1, 16) @ model.model.layers[0].mlp.gate.weight.T
    return logits.topk(2, largest=False).indices


def test_replayed_forward_equals_the_layer_by_hand_and_the_router_gets_its_gradient():
    model = _moe_model()
    ids = torch.randint(0, 32, (2, 5))
    idx = _bottom2(model, ids)  # [10, 2]
    routed = idx.view(2, 5, 1, 2).to(torch.int16)
    seen, hooks = _block_io(model)
    with replay(model, routed):
        model(input_ids=ids)
    block = model.model.layers[0].mlp
    gate_w = block.gate.weight.detach().clone().requires_grad_(True)
    expected = _by_hand(block, seen["x"].detach(), idx, gate_w)
    got = seen["y"].reshape(-1, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # gradient to the router through the recomputed weights: d(sum of layer output * r)/dW_g, by hand and replayed
    r = torch.randn_like(expected)
    (expected * r).sum().backward()
    model.zero_grad()
    seen["x"] = seen["x"].detach()
    for h in hooks:
        h.remove()
    x = seen["x"]
    with replay(model, routed):  # the block alone, on the same input, with the replay hook on its router
        out = block(x)
    (out.reshape(-1, 16) * r).sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    torch.testing.assert_close(block.gate.weight.grad, gate_w.grad, rtol=1e-4, atol=1e-6)


def test_the_aligned_forward_replays_the_given_experts():
    from qarl_cli.quant import build_scheme
    from qarl_cli.forward.aligned import AlignedExperts, align

    model = _moe_model()
    ids = torch.randint(0, 32, (2, 5))
    idx = _bottom2(model, ids)
    model = align(model, build_scheme(Int8Config(), "cpu"))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, AlignedExperts)
    seen = []
    h = experts.register_forward_hook(lambda m, a, o: seen.append(a[1]))
    with replay(model, idx.view(2, 5, 1, 2).to(torch.int16)):
        model(input_ids=ids)
    h.remove()
    assert torch.equal(seen[0], idx)


def test_unknown_positions_keep_the_routers_own_choice():
    model = _moe_model()
    ids = torch.randint(0, 32, (1, 4))
    own = []
    with replay(model, None, own):
        model(input_ids=ids)
    routed = torch.full((1, 4, 1, 2), -1, dtype=torch.int16)
    seen = []
    h = model.model.layers[0].mlp.experts.register_forward_hook(lambda m, a, o: seen.append(a[1]))
    with replay(model, routed):
        model(input_ids=ids)
    h.remove()
    assert torch.equal(seen[0], own[0][:, 0].long())


def test_agreement_on_a_hand_made_example():
    # 3 tokens x 2 layers, top-2. Layer 0: token 0 same set in another order, token 1 differs, token 2 same.
    # Layer 1: all three differ except token 2. Token 1 is not reported by the engine (valid False).
    own = torch.tensor([[[0, 1], [2, 3]], [[0, 2], [1, 2]], [[3, 1], [0, 3]]])
    engine = torch.tensor([[[1, 0], [2, 0]], [[0, 3], [1, 2]], [[1, 3], [3, 0]]])
    valid = torch.tensor([True, False, True])
    # counted pairs: (t0, l0) yes, (t0, l1) no, (t2, l0) yes, (t2, l1) yes -> 3 / 4; layer 0: 2/2, layer 1: 1/2
    assert routing_agreement(own, engine, valid) == {"moe/routing_agreement": 0.75,
                                                     "moe/routing_agreement_min_layer": 0.5}
    assert routing_agreement(own, engine, torch.zeros(3, dtype=torch.bool)) == {}


def test_a_dense_model_refuses_routing_replay_in_one_line():
    cfg = types.SimpleNamespace(model=TinyModelConfig(), rollout=TorchRolloutConfig(routing_replay=True))
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert "\n" not in str(e.value)
    assert "rollout.routing_replay=true" in str(e.value) and "tiny_arith" in str(e.value)
    assert check_config(types.SimpleNamespace(model=TinyModelConfig(), rollout=TorchRolloutConfig())) is False
    assert check_config(types.SimpleNamespace(model=TinyMoEModelConfig(), rollout=TorchRolloutConfig())) is True
    assert wanted(False, True, "m") is False


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory):
    from qarl_cli.models.tiny import ensure_tiny_model

    return ensure_tiny_model(TinyMoEModelConfig(cache_dir=str(tmp_path_factory.mktemp("models")), warm_start_steps=0),
                             log=lambda _: None)


@pytest.mark.parametrize("quant", [NoQuantConfig(), Int8Config()], ids=["none", "int8"])
def test_torch_engine_reports_its_routing_and_the_learner_replays_it(moe_src, quant):
    from transformers import AutoModelForCausalLM

    from qarl_cli.quant import build_scheme
    from qarl_cli.forward.aligned import align
    from qarl_cli.rollout.torch_engine import TorchEngine
    from qarl_cli.update.learner import token_logprobs
    from qarl_cli.update.sequences import pack

    scheme = build_scheme(quant, "cpu")
    engine = TorchEngine(TorchRolloutConfig(), moe_src, scheme, dtype="float32")
    prompts = [[3, 4, 5, 6], [7, 8]]
    batch = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=1)
    layers, k = 2, 2
    assert len(batch.routed_experts) == 4
    # Independently: the engine's own model re-run on prompt + response, its routing from transformers'
    # router logits (output_router_logits), top-k of the softmax.
    for i, resp, r in zip(batch.prompt_index, batch.response_ids, batch.routed_experts):
        seq = prompts[i] + resp
        assert r.shape == (len(seq) - 1, layers, k)
        with torch.no_grad():
            out = engine.model(input_ids=torch.tensor([seq[:-1]]), output_router_logits=True)
        ref = torch.stack([lg.topk(k, -1).indices for lg in out.router_logits], 1)
        assert torch.equal(r.long().sort(-1).values, ref.sort(-1).values)
    # The learner (its own copy, aligned the same way, its routers moved so that its own choice differs) routes
    # every token of the packed batch as the engine did.
    learner = align(AutoModelForCausalLM.from_pretrained(str(moe_src), dtype=torch.float32), scheme)
    with torch.no_grad():
        for layer in learner.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight))
    seqs = pack(prompts, batch)
    seen = []
    hooks = [learner.model.layers[l].mlp.experts.register_forward_hook(lambda m, a, o: seen.append(a[1]))
             for l in range(layers)]
    own = []
    with replay(learner, None, own):
        token_logprobs(learner, seqs.select(torch.arange(len(seqs))))
    seen.clear()
    token_logprobs(learner, seqs)
    for h in hooks:
        h.remove()
    differs = False
    for b, r in enumerate(batch.routed_experts):
        for l in range(layers):
            used = seen[l].view(len(seqs), -1, k)[b, :len(r)]
            assert torch.equal(used, r[:, l].long())
            differs |= not torch.equal(own[0].view(len(seqs), -1, layers, k)[b, :len(r), l].long(), used)
    assert differs  # without replay the learner would have routed some tokens elsewhere
    engine.close()


def test_a_router_the_hook_was_not_written_for_is_refused_in_one_line():
    from torch import nn

    from qarl_cli.forward.routing import routers

    class OtherRouter(nn.Module):
        top_k = 2

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].mlp = nn.Module()
    model.layers[0].mlp.gate = OtherRouter()
    with pytest.raises(ConfigError) as e:
        routers(model)
    assert "OtherRouter" in str(e.value) and "rollout.routing_replay=false" in str(e.value)
    assert "\n" not in str(e.value)
