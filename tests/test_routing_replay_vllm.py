"""Routing replay with rollout=vllm: the engine's batch carries exactly the experts vLLM reported for each sample
(read here from vLLM's own RequestOutput.routed_experts, through LLM.generate), and where this vLLM cannot return
them (vLLM 0.32 captures them only in its Model Runner V2, which needs Triton) the default turns replay off with a
note and an explicit true is refused in one line."""

import pytest
import torch

from qarl_cli.config.errors import UserError
from qarl_cli.config.model import TinyMoEModelConfig
from qarl_cli.config.quant import NoQuantConfig
from qarl_cli.config.stages import VLLMRolloutConfig
from qarl_cli.models.tiny import ensure_tiny_model
from qarl_cli.quant import build_scheme
from qarl_cli.rollout.routing import resolve_routing, routing_unavailable
from qarl_cli.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory):
    return ensure_tiny_model(TinyMoEModelConfig(cache_dir=str(tmp_path_factory.mktemp("models")), warm_start_steps=0),
                             log=lambda _: None)


@pytest.mark.skipif(routing_unavailable() is None, reason="this vLLM returns routed experts")
def test_without_capture_the_default_is_off_and_true_is_refused(moe_src):
    on, note = resolve_routing(VLLMRolloutConfig(), moe_src, "rollout=vllm")
    assert on is False and "Model Runner V2" in note and "\n" not in note
    with pytest.raises(UserError) as e:
        resolve_routing(VLLMRolloutConfig(routing_replay=True), moe_src, "rollout=vllm")
    assert str(e.value).startswith("rollout.routing_replay=true: ") and "\n" not in str(e.value)


@pytest.mark.skipif(routing_unavailable() is not None, reason=f"{routing_unavailable()}")
def test_the_batch_carries_vllms_own_routed_experts(moe_src):
    from vllm import SamplingParams

    engine = VLLMEngine(VLLMRolloutConfig(), moe_src, build_scheme(NoQuantConfig(), "cpu"), dtype="float32",
                        seed=0, max_model_len=64)
    try:
        assert engine.routing_replay
        prompts = [[3, 4, 5, 6], [7, 8, 9]]
        batch = engine.generate(prompts, n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=5)
        params = [SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=(5 * 1_000_003 + 2 * k) % 2**31,
                                 logprobs=0, detokenize=False) for k in range(2)]
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        own = [c for o in outputs for c in sorted(o.outputs, key=lambda c: c.index)]
        for c, ids, r, i in zip(own, batch.response_ids, batch.routed_experts, batch.prompt_index):
            assert list(c.token_ids) == ids
            assert r.shape == (len(prompts[i]) + len(ids) - 1, 2, 2)
            assert torch.equal(r.long(), torch.from_numpy(c.routed_experts).long())
    finally:
        engine.close()


def test_a_server_runs_with_the_capture_and_its_response_field_is_read():
    """rollout=vllm_server: the launch command carries vLLM's flag (and the model runner that captures), and the
    /v1/completions field, base64 .npy as vLLM's own serialiser writes it, is read back exactly."""
    from pathlib import Path

    import numpy as np
    from vllm.utils.serial_utils import numpy2base64

    from qarl_cli.config.stages import VLLMServerRolloutConfig
    from qarl_cli.rollout.routing import checked
    from qarl_cli.rollout.server_launch import server_command

    args = dict(dtype="float32", seed=0, max_model_len=64, on_gpu=False, identity="id")
    cmd, env = server_command(VLLMServerRolloutConfig(), Path("/m"), 8000, "k", routing=True, **args)
    assert "--enable-return-routed-experts" in cmd and env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    cmd, env = server_command(VLLMServerRolloutConfig(), Path("/m"), 8000, "k", **args)
    assert "--enable-return-routed-experts" not in cmd and "VLLM_USE_V2_MODEL_RUNNER" not in env
    routing = np.random.default_rng(0).integers(0, 4, (6, 2, 2)).astype(np.uint8)
    assert torch.equal(checked(numpy2base64(routing), 7, "x"), torch.from_numpy(routing).to(torch.int16))
    with pytest.raises(RuntimeError, match="--enable-return-routed-experts"):
        checked(None, 7, "rollout=vllm_server")
