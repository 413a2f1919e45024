"""algorithm.entropy_coef through the Learner (the objective's own arithmetic: test_objectives.py): the learner
computes the policy's next-token entropy when the coefficient asks for it, the objective reports it, and the
update moves the entropy the way the coefficient's sign says."""

import torch
from transformers import AutoModelForCausalLM

from qarl_cli.config.algorithm import TBPOConfig
from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.root import TrainConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.update.objectives import sequence_ratio_loss
from qarl_cli.rollout.base import RolloutBatch
from qarl_cli.update.learner import Learner
from qarl_cli.update.sequences import pack


def _entropy(model, seqs) -> float:
    """Mean over sequences of the mean over response positions of the next-token distribution's entropy (TBPO's
    seq-mean-token-mean), from the logits, written here independently of the learner."""
    with torch.no_grad():
        logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits[:, :-1].float()
    h = torch.distributions.Categorical(logits=logits).entropy()
    per_sequence = [h[b][seqs.mask[b]].mean() for b in range(len(seqs))]
    return float(sum(per_sequence) / len(per_sequence))


def test_entropy_coef_moves_the_policy_entropy_by_its_sign(tmp_path):
    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path), warm_start_steps=0, num_layers=1),
                            log=lambda _: None)
    batch = RolloutBatch([0, 0, 1, 1], [[5, 6], [7], [8, 9, 10], [11]], [[-1.0, -2.0], [-1.5], [-1, -1, -1], [-3.0]],
                         ["length"] * 4)
    seqs = pack([[3, 4], [3, 4, 5]], batch)
    # Advantages 0: the policy-gradient term is 0, so only the entropy term moves the weights. Plain SGD (a step
    # along the gradient, at full lr from the first step) so that a small step follows the gradient's sign.
    cfg = TrainConfig(optimizer="sgd", lr=0.05, warmup_steps=1)
    moved = {}
    for coef in (0.0, 0.5, -0.5):
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        learner = Learner(model, cfg, sequence_ratio_loss, torch.device("cpu"))
        before = _entropy(model, seqs)
        metrics = learner.update(seqs, learner.old_logprobs(seqs), torch.zeros(4), TBPOConfig(entropy_coef=coef),
                                 seed=0)
        if coef:
            assert abs(metrics["objective/entropy"] - before) < 1e-5 * before  # the pre-step forward's entropy
        else:
            assert "objective/entropy" not in metrics  # not computed when not asked for
        moved[coef] = _entropy(model, seqs) - before
    print("entropy change per coefficient:", moved)
    assert moved[0.0] == 0.0  # no signal, no entropy term: the weights stay
    assert moved[0.5] > 0 > moved[-0.5]  # a bonus raises the entropy, a negative coefficient sharpens
