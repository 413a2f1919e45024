"""train.micro_batch_size: a minibatch's gradient accumulated over micro-batches is the gradient of the minibatch
in one forward. The reference is computed here without the learner: the objective on the whole minibatch,
one backward, and the SGD step it implies; the learner must land on the same weights whatever the micro-batch
size, with every loss aggregation (each divides by tokens or by sequences, which micro-batches split unevenly)."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from qarl_cli.config.algorithm import TBPOConfig
from qarl_cli.config.errors import ConfigError
from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.root import TrainConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.update.base import PolicyBatch
from qarl_cli.update.objectives import sequence_ratio_loss
from qarl_cli.rollout.base import RolloutBatch
from qarl_cli.update.learner import Learner, token_logprobs
from qarl_cli.update.sequences import pack

LR = 0.5
# Responses of 1 to 5 tokens: micro-batches of 2 or 3 rows hold different token counts, so an unweighted mean of
# their losses would differ from the minibatch's.
RESPONSES = [[5], [6, 7, 8, 9, 10], [7, 8], [11, 12, 13], [9], [5, 6, 7, 8]]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5])


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path_factory.mktemp("tiny")), warm_start_steps=0,
                                             num_layers=1), log=lambda _: None)


def _load(src):
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)


def _seqs(model):
    batch = RolloutBatch([0, 1, 0, 1, 0, 1], RESPONSES, [[0.0] * len(r) for r in RESPONSES], ["length"] * 6)
    seqs = pack([[3, 4], [3, 4, 5, 6]], batch)
    with torch.no_grad():
        own = token_logprobs(model, seqs) * seqs.mask
    # Engine logprobs a little off the policy's (inside TBPO's band, so nothing is dropped) and pi_old further
    # off: ratios away from 1, so the clipped and dual-clipped branches take part.
    rollout = own + 1e-4 * seqs.mask
    old = own + torch.linspace(-0.3, 0.3, own.shape[1]) * seqs.mask
    return dataclasses.replace(seqs, rollout_logprobs=rollout), old


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_accumulated_step_equals_the_one_forward_step(src, loss_agg):
    algo = TBPOConfig(loss_agg=loss_agg)
    ref_model = _load(src)
    seqs, old = _seqs(ref_model)
    ref = PolicyBatch(token_logprobs(ref_model, seqs), old, seqs.rollout_logprobs, ADVANTAGES, seqs.mask, None)
    loss, _ = sequence_ratio_loss(ref, algo)
    loss.backward()
    expected = {k: (p - LR * p.grad).detach() for k, p in ref_model.named_parameters() if p.grad is not None}
    assert loss.abs().item() > 1e-3 and expected

    # SGD's first step is lr x gradient (its momentum buffer starts at the gradient); no clipping, no warm-up.
    cfg = dict(optimizer="sgd", lr=LR, warmup_steps=0, lr_schedule="constant", grad_clip=0.0)
    for size in (0, 1, 2, 4):
        model = _load(src)
        learner = Learner(model, TrainConfig(micro_batch_size=size, **cfg), sequence_ratio_loss, torch.device("cpu"))
        metrics = learner.update(seqs, old, ADVANTAGES, algo, seed=0)
        assert metrics["update/optimizer_steps"] == 1
        assert metrics["update/loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
        got = dict(model.named_parameters())
        for k, want in expected.items():
            torch.testing.assert_close(got[k].detach(), want, rtol=1e-5, atol=1e-6, msg=f"{k}, micro {size}")


def test_on_policy_pass_fills_pi_old_micro_batch_by_micro_batch(src):
    """Without a separate pi_old pass (old=None), pi_old is each row's first forward: the mismatch the learner
    reports against the engine must be the same in one forward and in micro-batches."""
    model = _load(src)
    seqs, _ = _seqs(model)
    cfg = dict(optimizer="sgd", lr=LR, warmup_steps=0, lr_schedule="constant")
    out = [Learner(_load(src), TrainConfig(micro_batch_size=n, **cfg), sequence_ratio_loss, torch.device("cpu"))
           .update(seqs, None, ADVANTAGES, TBPOConfig(), seed=0) for n in (0, 2)]
    assert out[0]["mismatch/k3_kl"] > 0
    assert out[1]["mismatch/k3_kl"] == pytest.approx(out[0]["mismatch/k3_kl"], rel=1e-4)


def test_micro_batch_size_is_validated():
    from qarl_cli.config.domains import check_domains  # ranges are the schema's DOMAINS, checked by validate

    with pytest.raises(ConfigError, match="^micro_batch_size=-1"):
        check_domains(TrainConfig(micro_batch_size=-1))


@pytest.mark.parametrize("n,world,chunk", [(9, 2, 5), (9, 2, 4), (9, 2, 2), (3, 4, 2), (8, 2, 3), (1, 3, 1)])
def test_every_rank_runs_the_same_number_of_chunks_and_each_row_is_used_once(n, world, chunk):
    """FSDP's forwards are collectives: a rank that ran one chunk fewer than another would leave it waiting. Given
    one chunk size (the learner now derives it from the minibatch, not from each rank's own share: 9 rows over 2
    ranks once gave chunks of 5 and 4, hence 1 and 2 forwards), every rank runs the same number of chunks, padding
    with weightless stand-ins, and every row is used exactly once."""
    from types import SimpleNamespace

    from qarl_cli.update.distributed import Distributed, rank_chunks

    rows = torch.arange(n)
    counts, used_rows = [], []
    for rank in range(world):
        dist = SimpleNamespace(rank=rank, world=world)
        dist.share = lambda r, d=dist: Distributed.share(d, r)
        chunks = list(rank_chunks(dist, rows, chunk))
        counts.append(len(chunks))
        assert all(0 < len(part) <= chunk for part, _ in chunks)
        used_rows += [int(i) for part, used in chunks if used for i in part]
    assert len(set(counts)) == 1, counts
    assert sorted(used_rows) == list(range(n))
