"""What routing replay changes, measured once per step at theta_old (before the update's first optimizer step):
one no-grad forward of the batch with the learner's own routing, against the engine's reported routing
(`moe/routing_agreement`, `moe/routing_agreement_min_layer`) and the engine's logprobs (`mismatch/k3_kl_no_replay`:
the k3 of mismatch.mismatch_metrics as it would be without replay). Run only when the batch carries routing."""

from __future__ import annotations

from typing import Any

import torch

from qarl_cli.forward.logprobs import next_token_logprobs
from qarl_cli.forward.routing_metrics import agreement_counts
from qarl_cli.forward.routing import replay
from qarl_cli.update.distributed import rank_chunks
from qarl_cli.update.sequences import Sequences


@torch.no_grad()
def no_replay_metrics(model: torch.nn.Module, seqs: Sequences, dist: Any, chunk: int,
                      device: torch.device) -> dict[str, float]:
    if seqs.routed_experts is None:
        return {}
    layers = seqs.routed_experts.shape[2]
    # sums over this rank's rows: agreeing (token, layer) pairs per layer, reported tokens, k3 sum, response tokens
    agree = torch.zeros(layers, dtype=torch.float64)
    tokens = torch.zeros(3, dtype=torch.float64)
    model.eval()
    for rows, used in rank_chunks(dist, torch.arange(len(seqs)), chunk):
        if not used:  # a stand-in row: the collective forward of other ranks' shards, nothing counted
            part = seqs.select(rows).to(device)
            next_token_logprobs(model, part.input_ids, part.attention_mask)
            continue
        part = seqs.select(rows).to(device)
        own: list = []
        with replay(model, None, own):
            logp = next_token_logprobs(model, part.input_ids, part.attention_mask).cpu().double()
        engine = part.routed_experts.reshape(-1, *part.routed_experts.shape[2:])
        valid = (engine >= 0).all(-1).all(-1) & part.attention_mask.cpu().reshape(-1).bool()
        same, n = agreement_counts(own[-1], engine, valid)
        agree += same
        m = part.mask.cpu()
        d = (logp - part.rollout_logprobs.cpu().double())[m].clamp(-20, 20)
        tokens += torch.tensor([n, (torch.expm1(d) - d).sum().item(), m.sum().item()], dtype=torch.float64)
    agree, tokens = dist.all_sum(agree), dist.all_sum(tokens)
    out = {}
    if tokens[0] > 0:
        out["moe/routing_agreement"] = (agree.sum() / (tokens[0] * layers)).item()
        out["moe/routing_agreement_min_layer"] = (agree / tokens[0]).min().item()
    if tokens[2] > 0:
        out["mismatch/k3_kl_no_replay"] = (tokens[1] / tokens[2]).item()
    return out
