"""sync/lowbit_changed_frac and sync/lowbit_changed_tensors: the fraction of quantized weight elements whose
low-bit value changed since the previous sync, and the matrices that changed at all, counted on the stream the sync
sends (prequantized: packed tensors; online: masters, quantized with the same scheme). Expected counts are worked
from the quantization rule: a change far below a quantization step changes nothing, one element moved by many steps
changes that element alone (its row's or group's amax, hence its scale, unchanged)."""

import pytest
import torch

from qarl_cli.config.quant import Int8Config, W4A16Config
from qarl_cli.quant import build_scheme
from qarl_cli.quant.checkpoint import quantized_state
from qarl_cli.quant.select import CheckpointPlan
from qarl_cli.sync.lowbit_changes import LowbitChanges

PLAN = CheckpointPlan(quantized=frozenset({"a.weight", "b.weight"}), kept=())


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    def rows(n):  # 0.1 <= |w| < 0.25 (no zero in int8 or int4) and each row's and group's amax 1 (columns 0, 32)
        w = (torch.rand(n, 64, generator=g) * 0.15 + 0.1) * (torch.randint(0, 2, (n, 64), generator=g) * 2 - 1)
        w[:, 0] = w[:, 32] = 1.0
        return w

    a, b = rows(8), rows(4)
    return {"a.weight": a, "b.weight": b, "norm.weight": torch.ones(64)}


def _sync(tracker, state, scheme, mode):
    stream = quantized_state(state, scheme, PLAN) if mode == "prequantized" else iter(state.items())
    sent = list(tracker.watch(stream))
    return sent


@pytest.mark.parametrize("mode", ["prequantized", "online"])
@pytest.mark.parametrize("quant", [Int8Config(), W4A16Config(group_size=32, scale_dtype="float32")],
                         ids=["int8", "w4a16"])
def test_changed_elements_and_matrices_by_hand(mode, quant):
    scheme = build_scheme(quant, "cpu")
    tracker = LowbitChanges(scheme, PLAN, mode)
    state = _state()
    sent = _sync(tracker, state, scheme, mode)
    want = list(quantized_state(state, scheme, PLAN)) if mode == "prequantized" else list(state.items())
    assert [n for n, _ in sent] == [n for n, _ in want]  # passed through unchanged
    assert tracker.commit() == {}  # the first sync has nothing to compare with

    a = state["a.weight"]
    a += torch.where(a.abs() < 0.5, 1e-7, 0.0)  # far below a step (int8: 1/127 or 1/64; int4: 1/7); amax unchanged
    _sync(tracker, state, scheme, mode)
    assert tracker.commit() == {"sync/lowbit_changed_frac": 0.0, "sync/lowbit_changed_tensors": 0}

    state["a.weight"][3, 5] = 0.9 if state["a.weight"][3, 5] < 0 else -0.9  # many steps, below the amax
    _sync(tracker, state, scheme, mode)
    assert tracker.commit() == {"sync/lowbit_changed_frac": 1 / (8 * 64 + 4 * 64), "sync/lowbit_changed_tensors": 1}

    # a new amax: row 2's scale (int4: its first group's) grows 1.37 times and every value under it changes
    # (q * s = q' * 1.37 s has no solution in integers this small)
    state["b.weight"][2, 0] = 1.37
    _sync(tracker, state, scheme, mode)
    assert tracker.commit() == {"sync/lowbit_changed_frac": (64 if quant.name == "int8" else 32) / (12 * 64),
                                "sync/lowbit_changed_tensors": 1}

def test_primed_with_the_served_weights_the_first_sync_is_compared():
    scheme = build_scheme(Int8Config(), "cpu")
    tracker = LowbitChanges(scheme, PLAN, "prequantized")
    state = _state()
    tracker.prime(quantized_state(state, scheme, PLAN))
    state["a.weight"][0, 9] = 0.9 if state["a.weight"][0, 9] < 0 else -0.9
    _sync(tracker, state, scheme, "prequantized")
    assert tracker.commit() == {"sync/lowbit_changed_frac": 1 / (12 * 64), "sync/lowbit_changed_tensors": 1}


def test_a_failed_push_is_not_the_previous_one():
    """A push the engine refused (no commit) leaves the comparison against the last weights the engine took."""
    scheme = build_scheme(Int8Config(), "cpu")
    tracker = LowbitChanges(scheme, PLAN, "prequantized")
    state = _state()
    _sync(tracker, state, scheme, "prequantized")
    tracker.commit()
    state["b.weight"][1, 7] = 0.9 if state["b.weight"][1, 7] < 0 else -0.9
    _sync(tracker, state, scheme, "prequantized")  # refused: no commit
    _sync(tracker, state, scheme, "prequantized")  # the same weights again, taken
    assert tracker.commit() == {"sync/lowbit_changed_frac": 1 / (12 * 64), "sync/lowbit_changed_tensors": 1}
