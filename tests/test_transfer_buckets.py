"""sync.buckets.write_buckets: what a push to vLLM servers writes before any server hears of it. Bucket
sizes stay under the limit (a tensor larger than one travels alone), every tensor travels once, a tied alias is
compared with its target and dropped, and a bad tensor anywhere in the stream is refused."""

import pytest
import torch
from safetensors.torch import load_file

from qarl_cli.rollout.base import WeightSyncError
from qarl_cli.sync.buckets import write_buckets

SPEC = {"embed.weight": ((8, 4), torch.float32), **{f"layers.{i}.w": ((16, 16), torch.float32) for i in range(6)},
        "big.weight": ((64, 64), torch.float32)}
ALIASES = {"lm_head.weight": "embed.weight"}


def _weights(gen_seed=0, alias_first=False):
    g = torch.Generator().manual_seed(gen_seed)
    w = {name: torch.randn(shape, generator=g) for name, (shape, _) in SPEC.items()}
    pairs = list(w.items())
    alias = ("lm_head.weight", w["embed.weight"].clone())
    return ([alias] + pairs if alias_first else pairs + [alias]), w


@pytest.mark.parametrize("alias_first", [False, True])
def test_buckets_bound_the_bytes_and_carry_each_tensor_once(tmp_path, alias_first):
    pairs, w = _weights(alias_first=alias_first)
    limit = 3 * 16 * 16 * 4  # three layer tensors
    paths, peak = write_buckets(iter(pairs), SPEC, ALIASES, tmp_path, "7", limit, "test")
    got = {}
    for p in paths:
        part = load_file(str(p))
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= limit or len(part) == 1  # big.weight (16 KiB) travels alone
        assert not set(part) & set(got)
        got.update(part)
    assert set(got) == set(SPEC)  # the alias is not sent: the server stores it once
    assert all(torch.equal(got[n], w[n]) for n in SPEC)
    assert peak == 64 * 64 * 4 and all(p.name.startswith("qarl-sync-7-") for p in paths)


@pytest.mark.parametrize("break_it, match", [
    (lambda w: w["layers.4.w"].__setitem__((0, 0), float("nan")), "layers.4.w.*NaN"),
    (lambda w: w.__setitem__("layers.5.w", torch.zeros(16, 15)), "layers.5.w.*shape"),
    (lambda w: w.__setitem__("layers.9.w", torch.zeros(16, 16)), "unknown weight 'layers.9.w'"),
    (lambda w: w.__setitem__("lm_head.weight", w["embed.weight"] + 1), "lm_head.weight.*differs"),
])
def test_a_bad_tensor_anywhere_is_refused(tmp_path, break_it, match):
    pairs, _ = _weights()
    w = dict(pairs)
    break_it(w)
    with pytest.raises(WeightSyncError, match=match):
        write_buckets(iter(w.items()), SPEC, ALIASES, tmp_path, "1", 1 << 20, "test")


def test_a_tensor_sent_twice_is_refused(tmp_path):
    pairs, _ = _weights()
    with pytest.raises(WeightSyncError, match="sent twice"):
        write_buckets(iter(pairs + pairs[:1]), SPEC, ALIASES, tmp_path, "1", 1 << 20, "test")
