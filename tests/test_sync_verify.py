"""The sync's verify probe measures, before training, how far the engine's kernels alone put its logprobs from the
trainer's on the weights both hold, and bounds every later verify by a few times that floor where it is above
sync.verify_tolerance: an engine computing in another dtype (here the torch engine in bf16 against the fp32
trainer: a real kernel floor, as vLLM's fp16 W4A16 or int8 W8A8 engines have on SmolLM2, 9e-3 and 0.2) is not
reported as stale after every sync, and a garbled one still is."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.quant import NoQuantConfig
from qarl_cli.config.stages import InplaceSyncConfig, TorchRolloutConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme
from qarl_cli.quant.checkpoint import load_meta_model, plan_for
from qarl_cli.rollout.base import WeightSyncError
from qarl_cli.sync.inplace import VERIFY_FLOOR_FACTOR, InplaceSync
from qarl_cli.rollout.torch_engine import TorchEngine

GEN = torch.Generator().manual_seed(3)
PROBE = [torch.randint(3, 100, (16,), generator=GEN).tolist() for _ in range(6)]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path_factory.mktemp("m")), warm_start_steps=0),
                             log=lambda _: None)


def _sync(src, tolerance):
    scheme = build_scheme(NoQuantConfig(), "cpu")
    return InplaceSync(InplaceSyncConfig(verify_every=1, verify_tolerance=tolerance), scheme,
                       plan_for(load_meta_model(src), scheme), PROBE)


def test_the_kernel_floor_raises_the_bound_and_a_garbled_engine_still_fails(src):
    engine = TorchEngine(TorchRolloutConfig(), src, build_scheme(NoQuantConfig(), "cpu"), dtype="bfloat16")
    trainer = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    loose = _sync(src, 1.0)
    assert loose.calibrate(trainer, engine) == "" and loose.tolerance == 1.0  # floor far below: nothing said
    tight = _sync(src, 1e-9)
    line = tight.calibrate(trainer, engine)
    floor = tight.tolerance / VERIFY_FLOOR_FACTOR
    assert 1e-4 < floor < 0.5  # bf16 rounding of the whole forward, measured
    assert line.startswith(f"sync verify: on the weights it started with, this engine's logprobs differ from the "
                           f"trainer's by {floor:.3g} on average") and "sync.verify_tolerance=1e-09" in line
    with torch.no_grad():  # a step's worth of change, sent: the engine stays at its floor from the trainer
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=GEN) * 1e-3)
    metrics = tight.push(trainer, engine)
    assert 0 < metrics["sync/verify_gap_mean"] <= tight.tolerance
    with pytest.raises(WeightSyncError, match="sync.verify_tolerance=1e-09"):  # the bound as it was: stale
        _sync(src, 1e-9).push(trainer, engine)
    tight.weights = lambda model: ((n, t * 0 + 0.3) for n, t in model.state_dict().items())  # garbled weights
    with pytest.raises(WeightSyncError, match=r"above .* \(3x the kernels' own gap, measured before training\)"):
        tight.push(trainer, engine)
    engine.close()
