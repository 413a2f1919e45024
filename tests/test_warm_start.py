"""The warm start's accuracy band: after its configured steps the build checks greedy accuracy on a held-out
split and trains on in chunks until it is inside the band, whatever the CPU's speed of learning. The band logic
runs here on given accuracy sequences (no model, no CPU dependence), then once through a real, small build."""

import json

import pytest

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.model import TinyModelConfig
from qarl_cli.data import arith
from qarl_cli.models.warm_start import default_test_split, heldout_split, train_until_in_band


def _run(accuracies, steps=800, chunk=100, max_steps=1600, band=(0.2, 0.45)):
    """train_until_in_band with a fake trainer (it records the chunks asked for) and the given measurements."""
    trained, measured = [], iter(accuracies)
    out = train_until_in_band(trained.append, lambda: next(measured), steps, chunk, max_steps, band)
    return out, trained


def test_in_band_at_once_trains_the_configured_steps_only():
    out, trained = _run([0.24])
    assert trained == [800]
    assert out == {"steps": 800, "heldout_accuracy": 0.24, "checks": [{"steps": 800, "accuracy": 0.24}],
                   "in_band": True}


def test_below_the_band_trains_in_chunks_until_inside():
    out, trained = _run([0.19, 0.195, 0.21, 0.3])  # the last value is never asked for
    assert trained == [800, 100, 100]
    assert [c["steps"] for c in out["checks"]] == [800, 900, 1000]
    assert (out["steps"], out["heldout_accuracy"], out["in_band"]) == (1000, 0.21, True)


def test_the_budget_bounds_the_steps_and_cuts_the_last_chunk():
    out, trained = _run([0.05] * 10, steps=800, chunk=300, max_steps=1500)
    assert trained == [800, 300, 300, 100]  # 1500 in all
    assert (out["steps"], out["in_band"]) == (1500, False)
    assert len(out["checks"]) == 4


def test_above_the_band_stops_there():
    out, trained = _run([0.6, 0.3])
    assert trained == [800] and (out["steps"], out["in_band"]) == (800, False)


def test_lower_edge_of_the_band_is_inside():
    out, trained = _run([0.2])
    assert trained == [800] and out["in_band"]


def test_no_budget_beyond_the_steps_measures_once():
    out, trained = _run([0.0, 0.5], max_steps=800)
    assert trained == [800] and out["checks"] == [{"steps": 800, "accuracy": 0.0}] and not out["in_band"]


def test_heldout_split_is_test_class_and_disjoint_from_the_test_split():
    held, test = heldout_split(300), default_test_split()
    assert len(held) == 300 and len({p.prompt for p in held}) == 300
    assert not {p.prompt for p in held} & {p.prompt for p in test}
    assert all(arith.is_test(p.prompt) for p in held)  # so never in any training stream
    assert sorted({p.level for p in held}) == [1, 2, 3]
    assert len(test) == 500 and test == arith.test_split(500, [1, 2, 3])  # the schema's size and levels


@pytest.mark.parametrize("field, value, message", [
    ("warm_start_target_band", [0.5, 0.2], "warm_start_target_band=[0.5, 0.2]: must be [low, high]"),
    ("warm_start_target_band", [0.2], "warm_start_target_band=[0.2]: must be [low, high]"),
    ("warm_start_target_band", [0.2, 1.5], "warm_start_target_band=[0.2, 1.5]: must be [low, high]"),
    ("warm_start_chunk_steps", 0, "warm_start_chunk_steps=0: must be >= 1"),
    ("warm_start_max_steps", 799, "warm_start_max_steps=799: must be >= warm_start_steps=800"),
    ("warm_start_check_size", 0, "warm_start_check_size=0: must be >= 1"),
])
def test_config_rejects(field, value, message):
    from qarl_cli.config.domains import check_domains  # ranges are the schema's DOMAINS, checked by validate

    with pytest.raises(ConfigError) as err:
        check_domains(TinyModelConfig(**{field: value}))
    assert str(err.value).startswith(message)


def test_config_defaults():
    cfg = TinyModelConfig()
    assert (cfg.warm_start_steps, cfg.warm_start_target_band, cfg.warm_start_chunk_steps, cfg.warm_start_max_steps,
            cfg.warm_start_check_size) == (800, [0.20, 0.45], 100, 1600, 500)


def test_a_build_below_its_band_continues_to_its_budget_and_records_it(tmp_path):
    """A real build (one layer, 2 + 2 x 1 steps) whose band no model reaches: the recorded steps and checks are
    the band logic's, in the model directory's qarl_build.json, and the weights are those of 4 steps."""
    from safetensors.torch import load_file

    from qarl_cli.models.tiny import BUILD_MARKER, ensure_tiny_model

    common = dict(cache_dir=str(tmp_path), num_layers=1, warm_start_batch=4, warm_start_check_size=6,
                  warm_start_chunk_steps=1)
    path = ensure_tiny_model(TinyModelConfig(**common, warm_start_steps=2, warm_start_max_steps=4,
                                             warm_start_target_band=[0.99, 1.0]), log=lambda _: None)
    info = json.loads((path / BUILD_MARKER).read_text())["warm_start"]
    assert info["steps"] == 4 and not info["in_band"]
    assert [c["steps"] for c in info["checks"]] == [2, 3, 4]
    assert all(0 <= c["accuracy"] <= 1 for c in info["checks"])
    assert info["heldout_accuracy"] == info["checks"][-1]["accuracy"]
    # The same recipe asked for 4 steps outright (a band any accuracy is in) ends with the same weights.
    straight = ensure_tiny_model(TinyModelConfig(**common, warm_start_steps=4, warm_start_target_band=[0.0, 1.0]),
                                 log=lambda _: None)
    assert straight != path
    a, b = load_file(str(path / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert json.loads((straight / BUILD_MARKER).read_text())["warm_start"]["steps"] == 4


@pytest.mark.parametrize("task", ["arith", "arith_cot"])
def test_each_task_teaches_its_response_on_problems_disjoint_from_its_checks(tmp_path, task):
    """The supervised batch's labels are the task's response (the boxed answer, or the worked solution ending in
    it) and EOS, nothing of the prompt; the held-out check split is disjoint from the test split and from the
    training stream the warm start draws from."""
    import itertools

    from qarl_cli.data import arith_cot
    from qarl_cli.models.tokenizer import BOXED, build_tokenizer
    from qarl_cli.models.warm_start import TASKS, supervised_batch

    tok = build_tokenizer(tmp_path)
    spec = TASKS[task]
    problems = list(itertools.islice(spec.stream(1234), 8))
    ids, labels, mask = supervised_batch(tok, problems, spec.response)
    for row, lab, m, p in zip(ids, labels, mask, problems):
        taught = [int(t) for t in lab if t != -100]
        assert taught[-1] == tok.eos_token_id
        text = tok.decode(taught[:-1])
        expected = arith_cot.solution(p.prompt) if task == "arith_cot" else f"{BOXED}{p.answer}}}"
        assert text.replace(" ", "") == expected.replace(" ", "") and text.endswith(f"{BOXED}{p.answer}}}")
        assert taught.count(tok.convert_tokens_to_ids(BOXED)) == 1  # \boxed{ is one token, written once
        assert [int(t) for t in row[m.bool()][-len(taught):]] == taught  # the sequence ends with its response
    held, test = heldout_split(200, task), default_test_split(task)
    train = {p.prompt for p in itertools.islice(spec.stream(1234), 3000)}
    assert len(held) == 200 and not {p.prompt for p in held} & {p.prompt for p in test}
    assert not {p.prompt for p in held} & train and not {p.prompt for p in test} & train
    assert max(len(tok(spec.response(p))["input_ids"]) for p in test) + 1 <= spec.max_new_tokens
