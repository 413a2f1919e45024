"""Weight transfer into a vLLM server on a GPU (gpu marker: scripts/gpu_check.sh runs these where CUDA is):
qarl_gloo into a GPU server (one GPU), and vLLM's own nccl backend (two GPUs: NCCL refuses a group whose trainer
and worker share a device, so with one GPU that test is skipped and says so). The CPU suite checks the same
protocol end to end over gloo (test_rollout_network.py); these check what only a GPU has."""

import pytest
import torch

from qarl_cli.config.quant import Int8Config, NoQuantConfig
from qarl_cli.config.stages import InplaceSyncConfig, VLLMServerRolloutConfig

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _setup(tmp_path, quant, **kw):
    from qarl_cli.config.model import TinyModelConfig
    from qarl_cli.models.tiny import ensure_tiny_model
    from qarl_cli.quant import build_scheme
    from qarl_cli.rollout.vllm_server import ServerEngine
    from test_rollout_server import _sync, _trainer

    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path / "models"), warm_start_steps=0),
                            log=lambda _: None)
    cfg = VLLMServerRolloutConfig(gpu_memory_utilization=0.3, **kw)
    engine = ServerEngine(cfg, src, build_scheme(quant, "cuda"), dtype="float32", seed=0, max_model_len=64,
                          device="cuda")
    return engine, _trainer(src, quant), _sync(src, quant)


def _pushes_verified(engine, trainer, sync, label: str) -> None:
    """Two pushes of perturbed weights, each verified by the probe (sync.verify_every=1); then both closed."""
    from test_rollout_server import _perturb

    try:
        for seed in (1, 2):
            _perturb(trainer, seed)
            m = sync.push(trainer, engine)
            print(f"{label}: time/sync {m['time/sync']:.3f} s, gap {m['sync/verify_gap_mean']:.2e}")
            assert m["sync/verify_gap_mean"] < InplaceSyncConfig.verify_tolerance
    finally:
        sync.close()
        engine.close()


def test_gloo_into_a_gpu_server(tmp_path):
    _pushes_verified(*_setup(tmp_path, Int8Config(), transfer_backend="qarl_gloo"), "qarl_gloo -> GPU server")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="nccl needs the trainer and the server on different GPUs; this machine has fewer than 2")
def test_nccl_into_a_server_on_another_gpu(tmp_path):
    torch.cuda.set_device(0)  # the trainer's end of the group; the server gets GPU 1
    _pushes_verified(*_setup(tmp_path, NoQuantConfig(), transfer_backend="nccl", devices=["1"]),
                     "nccl -> server on GPU 1")
