"""rollout=torch against independently computed references: transformers' own greedy `generate`, a one-pass
recompute of the sampled tokens' logprobs, and a trainer-side aligned model for the weight syncs (full,
partial and refused ones).

The logprob comparisons run in float64. In float32 the engine's batched, cached forward and the one-pass
recompute differ by float rounding (~1e-7), and int8's activation quantization turns the rare value that sits on a
rounding boundary into a one-level step: a few 1e-3 in a logprob. In float64 the inputs the quantizer rounds (it
works in fp32) are the same in both layouts."""

import json
import re
import shutil

import pytest
import torch

from qarl_cli.config.model import TinyModelConfig, TinyMoEModelConfig
from qarl_cli.config.quant import SCHEMAS
from qarl_cli.config.stages import TorchRolloutConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme
from qarl_cli.forward.aligned import align
from qarl_cli.quant.checkpoint import plan_for, quantized_state
from qarl_cli.quant.select import checkpoint_state
from qarl_cli.rollout.base import WeightSyncError, build_engine
from qarl_cli.rollout.torch_engine import TorchEngine

PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33]]
SEQS = [[5, 6, 7, 40, 41, 42], [9, 8, 7, 6, 5, 4, 3, 50, 51], [20, 21]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny models' ops take microseconds; split over two threads each one waits at an OpenMP barrier, which
    costs milliseconds whenever the other core is busy (seen here: 15 ms per 3x128 linear, the file 10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    quiet = lambda _: None  # noqa: E731
    return {"dense": ensure_tiny_model(TinyModelConfig(cache_dir=str(root), warm_start_steps=0), log=quiet),
            "moe": ensure_tiny_model(TinyMoEModelConfig(cache_dir=str(root), warm_start_steps=0), log=quiet)}


def scheme_of(name, kernel="fake"):
    """"wna16:3" is quant=wna16 quant.bits=3."""
    name, _, bits = name.partition(":")
    return build_scheme(SCHEMAS[name](kernel=kernel, **({"bits": int(bits)} if bits else {})), "cpu")


def engine(path, quant="int8", batch_size=4, dtype="float64", kernel="fake"):
    eng = build_engine(TorchRolloutConfig(batch_size=batch_size), path, scheme_of(quant, kernel), dtype=dtype,
                       device="cpu")
    assert isinstance(eng, TorchEngine) and eng.name == "torch"
    return eng


def aligned(path, quant="int8", dtype=torch.float64, kernel="fake"):
    """The trainer's view: the checkpoint (float64 unless told) with the aligned forward, and its plan (taken
    before align, which only recognizes plain nn.Linear layers)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    plan = plan_for(model, scheme_of(quant, kernel))
    return align(model, scheme_of(quant, kernel)).eval().requires_grad_(False), plan


@torch.no_grad()
def logprobs(model, seq, start=1):
    """log p(seq[t] | seq[:t]) for t >= start, from one forward over the unpadded sequence."""
    logits = model(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits[start - 1:-1], -1).gather(-1, torch.tensor(seq[start:])[:, None])[:, 0]


def perturb(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5 * p.std())
    return model


def assert_scores(eng, model, tol=1e-5):
    for got, seq in zip(eng.score(SEQS), SEQS):
        torch.testing.assert_close(torch.tensor(got), logprobs(model, seq), rtol=0, atol=tol)


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("quant", ["int8", "none"])
def test_greedy_is_transformers_generate_stopping_at_eos(paths, tmp_path, quant):
    # A second EOS token that greedy decoding emits for some prompts only: some responses stop, others run out.
    probes = engine(paths["dense"], quant, dtype="float32").generate(PROMPTS, 1, 0.0, 1.0, 8, seed=0).response_ids
    stop = next(t for ids in probes for t in ids if not all(t in other for other in probes))
    model_dir = tmp_path / "model"
    shutil.copytree(paths["dense"], model_dir)
    gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**gen_cfg, "eos_token_id": [1, stop]}))

    batch = engine(model_dir, quant, dtype="float32").generate(PROMPTS, 2, 0.0, 1.0, 8, seed=0)
    assert batch.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3] and len(batch) == 8 and batch.seconds > 0
    assert all(len(lp) == n for lp, n in zip(batch.rollout_logprobs, batch.lengths))
    assert set(batch.finish_reasons) == {"stop", "length"}
    ref, _ = aligned(model_dir, quant, torch.float32)  # argmax: float32's rounding noise does not matter
    for i, (ids, reason) in enumerate(zip(batch.response_ids, batch.finish_reasons)):
        prompt = PROMPTS[batch.prompt_index[i]]
        out = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=8, do_sample=False)
        assert ids == out[0, len(prompt):].tolist()
        stopped = ids[-1] in (1, stop)
        assert reason == ("stop" if stopped else "length") and (stopped or len(ids) == 8)
        assert not any(t in (1, stop) for t in ids[:-1])


@pytest.mark.parametrize("quant", ["int8", "none"])
def test_rollout_logprobs_are_the_models_and_the_seed_decides(paths, quant):
    eng = engine(paths["dense"], quant, batch_size=3)  # 8 samples: chunks of 3, 3 and 2
    ref, _ = aligned(paths["dense"], quant)
    for temperature, top_p in ((1.0, 1.0), (0.5, 0.8)):  # raw logprobs, whatever the sampling settings
        sampled = eng.generate(PROMPTS, 2, temperature, top_p, 6, seed=7)
        for i, (ids, lps) in enumerate(zip(sampled.response_ids, sampled.rollout_logprobs)):
            prompt = PROMPTS[sampled.prompt_index[i]]
            expected = logprobs(ref, prompt + ids, start=len(prompt))
            torch.testing.assert_close(torch.tensor(lps), expected, rtol=0, atol=1e-5)
    batch = eng.generate(PROMPTS, 2, 1.0, 1.0, 6, seed=7)
    assert batch.response_ids[0] != batch.response_ids[1]  # two samples of one prompt
    again = eng.generate(PROMPTS, 2, 1.0, 1.0, 6, seed=7)
    assert again.response_ids == batch.response_ids and again.rollout_logprobs == batch.rollout_logprobs
    assert eng.generate(PROMPTS, 2, 1.0, 1.0, 6, seed=8).response_ids != batch.response_ids


@pytest.mark.parametrize("kind, mode, quant, kernel", [
    ("dense", "prequantized", "int8", "fake"), ("dense", "online", "int8", "fake"),
    ("moe", "prequantized", "int8", "fake"), ("moe", "online", "int8", "fake"),
    ("dense", "prequantized", "int8", "lowbit"),  # the sent int8 tensors go to _int_mm as they are
    ("dense", "prequantized", "fp8_block", "fake"), ("moe", "prequantized", "w4a16", "fake"),
    ("dense", "prequantized", "nvfp4", "fake"), ("moe", "prequantized", "nvfp4", "fake"),  # packed codes + scales
    ("moe", "prequantized", "mxfp4", "fake"),
    ("dense", "prequantized", "wna16:3", "fake"), ("moe", "online", "wna16:2", "fake"),  # 10 and 16 to a word
    ("dense", "prequantized", "wna16:3", "lowbit"), ("moe", "prequantized", "wna16:8", "fake")])
def test_sync_serves_the_trainers_weights(paths, kind, mode, quant, kernel):
    eng = engine(paths[kind], quant, kernel=kernel)
    before = eng.score(SEQS)

    def state(model, plan):
        return quantized_state(model, scheme_of(quant), plan) if mode == "prequantized" \
            else checkpoint_state(model).items()

    trainer, plan = aligned(paths[kind], quant, kernel=kernel)
    eng.load_weights(state(perturb(trainer), plan), mode)
    assert_scores(eng, trainer)
    assert max_diff(eng.score(SEQS), before) > 1e-2
    eng.load_weights(state(*aligned(paths[kind], quant)), mode)  # the checkpoint's own weights: back exactly
    assert eng.score(SEQS) == before


@pytest.mark.parametrize("kind, names", [
    ("dense", ["model.layers.0.self_attn.q_proj", "model.layers.2.mlp.down_proj"]),
    ("moe", ["model.layers.0.mlp.experts.1.up_proj", "model.layers.1.self_attn.v_proj"])])
def test_partial_prequantized_loads_keep_the_other_weights(paths, kind, names):
    eng = engine(paths[kind])
    eng.score(SEQS)  # every aligned module has built its cache
    trainer, plan = aligned(paths[kind])
    perturb(trainer)
    state = dict(quantized_state(trainer, scheme_of("int8"), plan))
    expected, _ = aligned(paths[kind])
    masters, new = checkpoint_state(expected), checkpoint_state(trainer)
    for name in names:  # one matrix at a time; the earlier ones must survive the later loads
        eng.load_weights((k, v) for k, v in state.items() if k.rsplit(".", 1)[0] == name)
        masters[f"{name}.weight"].copy_(new[f"{name}.weight"])
    _load_masters(expected, masters)
    assert_scores(eng, expected)


def _load_masters(model, masters):
    """Write checkpoint-named tensors back into `model` (fused experts: gate rows, then up rows)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in masters.items():
            if name in params:
                params[name].copy_(t)
                continue
            parent, e, proj, _ = name.rsplit(".", 3)
            if proj == "down_proj":
                params[f"{parent}.down_proj"][int(e)].copy_(t)
            else:
                gu = params[f"{parent}.gate_up_proj"][int(e)]
                gu[: gu.shape[0] // 2].copy_(t) if proj == "gate_proj" else gu[gu.shape[0] // 2:].copy_(t)


def test_bad_weights_are_refused_and_nothing_changes(paths):
    eng = engine(paths["dense"])
    before = eng.score(SEQS)
    trainer, plan = aligned(paths["dense"])
    good = list(quantized_state(perturb(trainer), scheme_of("int8"), plan))  # would change every logprob

    def bad(name, tensor):
        return [(k, v) for k, v in good if k != name] + [(name, tensor)]  # the offender comes last

    scale = dict(good)["model.layers.1.self_attn.q_proj.weight_scale"].clone()
    scale[3] = float("nan")
    cases = [bad("model.layers.1.self_attn.q_proj.weight_scale", scale),
             bad("lm_head.weight", torch.zeros(104, 127, dtype=torch.float64)),
             bad("model.layers.0.mlp.down_proj.weight", torch.zeros(128, 384)),  # float where int8 is served
             good + [("model.layers.0.self_attn.qq_proj.weight", torch.zeros(1))],
             [(k, v) for k, v in good if k != "model.layers.3.mlp.up_proj.weight_scale"]]  # scale missing
    names = ["q_proj.weight_scale", "lm_head.weight", "down_proj.weight", "qq_proj.weight", "up_proj.weight_scale"]
    for weights, name in zip(cases, names):
        with pytest.raises(WeightSyncError, match=re.escape(name)):
            eng.load_weights(weights)
        assert eng.score(SEQS) == before


def test_greedy_ignores_the_seed_and_a_tiny_top_p_is_greedy(paths):
    eng = engine(paths["dense"])
    greedy = eng.generate(PROMPTS, 2, 0.0, 1.0, 6, seed=0)
    assert eng.generate(PROMPTS, 2, 0.0, 1.0, 6, seed=1).response_ids == greedy.response_ids
    for seed in (0, 1):
        nucleus = eng.generate(PROMPTS, 2, 1.0, 1e-6, 6, seed=seed)
        assert nucleus.response_ids == greedy.response_ids
        assert nucleus.rollout_logprobs == greedy.rollout_logprobs  # raw logprobs, whatever top-p kept
