"""rollout.sleep_between_steps: a colocated vLLM engine sleeps while the trainer updates and wakes for the sync
and the next rollout. vLLM's sleep mode needs CUDA (its allocator offloads and frees device memory), so the
engine test runs on a GPU only (scripts/gpu_check.sh); the loop's part, that every update happens between a
sleep and a wake, runs here on the embedded engine, whose sleep is a no-op, by recording the calls."""

import pytest
import torch

from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.quant import Int8Config
from qarl_cli.config.stages import VLLMRolloutConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme


@pytest.mark.gpu
def test_sleep_frees_gpu_memory_and_wake_restores_the_weights(tmp_path):
    from qarl_cli.rollout.vllm_engine import VLLMEngine

    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path / "models"), warm_start_steps=0),
                            log=lambda _: None)
    cfg = VLLMRolloutConfig(sleep_between_steps=True, gpu_memory_utilization=0.3)
    engine = VLLMEngine(cfg, src, build_scheme(Int8Config(), "cuda"), dtype="bfloat16", seed=0, max_model_len=64,
                        device="cuda")
    try:
        prompts = [[3, 4, 5, 6], [7, 8, 9]]
        before = engine.generate(prompts, 1, 0.0, 1.0, 8, seed=0)
        awake = torch.cuda.mem_get_info()[0]
        engine.sleep()
        asleep = torch.cuda.mem_get_info()[0]
        engine.wake_up()
        after = engine.generate(prompts, 1, 0.0, 1.0, 8, seed=0)
        freed = (asleep - awake) / 2**30
        print(f"sleep freed {freed:.2f} GiB of GPU memory")
        # gpu_memory_utilization=0.3 of the card is the engine's (weights + KV cache); most of it comes back.
        assert freed > 0.2 * 0.3 * torch.cuda.mem_get_info()[1] / 2**30
        assert after.response_ids == before.response_ids  # greedy: the weights are the ones it slept with
    finally:
        engine.close()


def test_every_update_runs_between_a_sleep_and_a_wake(tmp_path, monkeypatch):
    """Two steps of the loop on the embedded engine and the default (warm-started) tiny model; the engine's sleep, wake_up, generate
    and load_weights calls and the learner's update are recorded in order."""
    from qarl_cli.rollout.torch_engine import TorchEngine
    from qarl_cli.update.learner import Learner
    from qarl_cli.cli import main

    calls = []
    for cls, names in ((TorchEngine, ("sleep", "wake_up", "generate", "load_weights")), (Learner, ("update",))):
        for name in names:
            def wrap(self, *a, _orig=getattr(cls, name), _name=name, **k):
                calls.append(_name)
                return _orig(self, *a, **k)
            monkeypatch.setattr(cls, name, wrap)
    rc = main(["train", "rollout=torch", "steps=2", "prompts_per_step=8", "samples_per_prompt=4", "eval_every=0",
               "checkpoint_every=0", "reward.num_workers=1", f"hydra.run.dir={tmp_path / 'run'}"])
    assert rc == 0
    updates = [i for i, c in enumerate(calls) if c == "update"]
    assert updates, calls  # something was trained (else the test shows nothing)
    for i in updates:
        assert calls[i - 1] == "sleep" and calls[i + 1] == "wake_up", calls
    for i, c in enumerate(calls):
        if c in ("generate", "load_weights"):  # never while asleep
            assert calls[:i].count("sleep") == calls[:i].count("wake_up"), calls
