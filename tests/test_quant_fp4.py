"""nvfp4 and mxfp4 numerics: the E2M1 grid and its ties listed by hand, scales worked out by hand, and the
references against the definitions they follow, run from the installed libraries: compressed-tensors' observer
and quantizer (how a checkpoint's weights are made) and vLLM's own emulation helpers (how the engine quantizes
activations and dequantizes weights)."""

import pytest
import torch

from qarl_cli.config.errors import ConfigError
from qarl_cli.config.quant import MxFp4Config, NvFp4Config
from qarl_cli.quant import fp4, mxfp4, nvfp4

# (input, expected value): every grid point, every midpoint (a tie goes to the even mantissa: 0, 1, 1, 2, 2, 4, 4),
# a value just off each of two midpoints, saturation, and signs.
E2M1_CASES = [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0), (1.5, 1.5), (2.0, 2.0), (3.0, 3.0), (4.0, 4.0), (6.0, 6.0),
              (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
              (0.2500001, 0.5), (5.0000005, 6.0), (6.5, 6.0), (1e30, 6.0), (-0.75, -1.0), (-5.5, -6.0), (-3.1, -3.0)]


def test_e2m1_rounding_codes_and_packing():
    x = torch.tensor([c[0] for c in E2M1_CASES])
    codes = fp4.round_e2m1(x)
    assert fp4.decode_e2m1(codes).tolist() == [c[1] for c in E2M1_CASES]
    assert codes[:8].tolist() == list(range(8))  # the grid's index
    assert fp4.round_e2m1(torch.tensor([-6.0, -0.5, -0.1, -0.0])).tolist() == [15, 9, 8, 8]  # sign in bit 3
    packed = fp4.pack_e2m1(torch.tensor([[1, 7, 15, 0]], dtype=torch.uint8))
    assert packed.tolist() == [[0x71, 0x0F]]  # the first of a pair in the low nibble
    assert fp4.unpack_e2m1(packed).tolist() == [[1, 7, 15, 0]]


def test_nvfp4_weight_scales_by_hand():
    """Tensor amax 6: g = 2688 / 6 = 448, and its block gets s = 448. A block of amax 3: s = 448 * 3 / 6 = 224
    (an e4m3 value), step s / g = 0.5. A block of amax 1: 448 / 6 = 74.67 lies between the e4m3 values 72 and 80 (step 8 in [64, 128)):
    s = 72, so its amax becomes 1 / (72 / 448) = 6.22 and saturates at 6."""
    w = torch.zeros(1, 48)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, -0.75, 0.3
    w[0, 16], w[0, 17] = 3.0, 0.75  # 0.75 / 0.5 = 1.5 exactly
    w[0, 32], w[0, 33] = 1.0, 0.5
    p = nvfp4.quantize_weight_ref(w)
    assert p["weight_global_scale"].tolist() == [448.0]
    assert p["weight_scale"].float().tolist() == [[448.0, 224.0, 72.0]]
    values = nvfp4.dequantize_ref(p, torch.float32)
    assert values[0, :3].tolist() == [6.0, -1.0, 0.5]  # step 448 / 448 = 1: -0.75 is a tie (-> -1), 0.3 -> 0.5
    assert values[0, 16:18].tolist() == [3.0, 0.75]
    step = 72.0 * (1 / 448.0)
    torch.testing.assert_close(values[0, 32:34], torch.tensor([6 * step, 3 * step]), rtol=0, atol=1e-7)


def test_mxfp4_scale_exponents_by_hand():
    """amax 6 = 1.5 * 2**2 keeps its exponent: e = 2 - 2 = 0 (byte 127, scale 1). amax 7 = 1.75 * 2**2 rounds up
    to 8: e = 1, scale 2 (7 / 2 = 3.5 -> 4). amax 0.75 = 1.5 * 2**-1: e = -3. An all-zero block: byte 0."""
    amax = torch.tensor([6.0, 7.0, 0.75, 0.0, 1.7499999])
    assert mxfp4.scale_exponent(amax).tolist() == [127, 128, 124, 0, 125]
    assert mxfp4.exponent_scale(torch.tensor([127, 128, 124, 0], dtype=torch.uint8)).tolist() == \
        [1.0, 2.0, 0.125, 2.0 ** -127]
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[1, 0] = 7.0, 1.0, 0.0
    codes, e8m0 = mxfp4.quantize_ref(x)
    assert e8m0.tolist() == [[128], [0]]
    assert mxfp4.dequantize_ref(codes, e8m0, torch.float32)[0, :2].tolist() == [8.0, 1.0]


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 128, generator=g) * torch.rand(24, 1, generator=g) * 0.1
    w[0, :16] = 0.0  # an all-zero block
    w[1, :32] = 1e-9  # a block whose e4m3 scale rounds to 0
    w[2, 5] = 0.9  # the tensor amax
    return w


def test_nvfp4_weights_are_compressed_tensors_quantization():
    """The observer's scales and the quantizer's values of compressed-tensors' NVFP4 preset, on fp32 weights."""
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = PRESET_SCHEMES["NVFP4"]["weights"]
    w = _weights()
    gparam = generate_gparam(w.min(), w.max())
    blocks = w.reshape(24, 8, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gparam)
    ours = nvfp4.quantize_weight_ref(w)
    assert torch.equal(ours["weight_global_scale"], gparam)
    assert torch.equal(ours["weight_scale"].view(torch.uint8), scale.to(torch.float8_e4m3fn).view(torch.uint8))
    cast = FP4_E2M1_DATA.cast_to_fp4
    with _eager(FP4_E2M1_DATA, "cast_to_fp4", getattr(cast, "_torchdynamo_orig_callable", cast)):
        q = quantize(w, scale, torch.zeros_like(scale), args, global_scale=gparam)
    assert torch.equal(fp4.decode_e2m1(fp4.unpack_e2m1(ours["weight_packed"])), q)


def test_mxfp4_scales_are_compressed_tensors_ones():
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = _weights(1)
    w[3, :32] = torch.tensor([7.0, 6.9, 1.75, 2 ** -130] * 8)  # amax rounding up a binade; a subnormal block
    blocks = w.reshape(24, 4, 32)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), PRESET_SCHEMES["MXFP4"]["weights"])
    _, e8m0 = mxfp4.quantize_ref(w)
    assert torch.equal(e8m0, compress_mx_scale(scale, torch.uint8))


def test_nvfp4_matches_vllm_emulation():
    """vLLM's ref_nvfp4_quant for activations (static global scale) and dequantize_to_dtype for weights."""
    from vllm.model_executor.layers.quantization.utils import nvfp4_emulation_utils as emu

    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 64, generator=g) * 4
    x[0, :16] = 0.0
    x[1, :16] = 0.125 + torch.arange(16) * 0.25  # values on E2M1 midpoints after scaling
    scheme = nvfp4.NvFp4Scheme(NvFp4Config(input_amax=20.0), "cpu")
    codes, s = scheme.quantize_act(x)
    ref_q, ref_s = emu.ref_nvfp4_quant(x, scheme.input_global_scale.reshape(()), 16)
    assert torch.equal(fp4.decode_e2m1(codes), ref_q) and torch.equal(s, ref_s)
    assert torch.equal(scheme.fake_quant_act(x), emu.ref_nvfp4_quant_dequant(x, scheme.input_global_scale, 16))
    p = nvfp4.quantize_weight_ref(_weights())
    inv = 1.0 / p["weight_global_scale"]
    for dtype in (torch.float32, torch.bfloat16):
        ref = emu.dequantize_to_dtype(p["weight_packed"], p["weight_scale"], inv, dtype, 16, swizzle=False)
        assert torch.equal(nvfp4.dequantize_ref(p, dtype), ref)


def test_e2m1_rounding_is_vllms_cast():
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import cast_to_fp4

    y = torch.linspace(-6.5, 6.5, 2601)  # steps of 0.005: every midpoint and its neighbours
    assert torch.equal(fp4.decode_e2m1(fp4.round_e2m1(y)).abs(), cast_to_fp4(y.clamp(-6, 6).clone()).abs())


def test_block_misfit_and_weight_only_activations():
    with pytest.raises(ConfigError, match="quant=mxfp4: a linear's input dimension \\(48\\)"):
        mxfp4.MxFp4Scheme(MxFp4Config(), "cpu").quantize(torch.ones(4, 48))
    x = torch.randn(3, 64)
    assert torch.equal(nvfp4.NvFp4Scheme(NvFp4Config(activations=False), "cpu").fake_quant_act(x), x)
    assert not torch.equal(mxfp4.MxFp4Scheme(MxFp4Config(), "cpu").fake_quant_act(x), x)
    with pytest.raises(ConfigError, match="kernel='lowbit'"):
        NvFp4Config(kernel="lowbit")


class _eager:
    """Swap compressed-tensors' torch.compile'd cast for the function it wraps (no C++ compile in a test)."""

    def __init__(self, owner, name, fn):
        self.owner, self.name, self.fn = owner, name, fn

    def __enter__(self):
        self.saved = self.owner.__dict__[self.name]
        setattr(self.owner, self.name, staticmethod(self.fn))

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.saved)


def test_vllm_serves_fp4_only_on_a_gpu():
    from qarl_cli.machine.capabilities import vllm_serving

    for name in ("nvfp4", "mxfp4"):
        for moe in (False, True):
            cpu = vllm_serving(name, moe=moe, gpu=False, flags=frozenset({"avx512f", "amx_tile", "amx_bf16"}))
            assert not cpu.served and f"no CPU kernel for {name}" in cpu.reason
            gpu = vllm_serving(name, moe=moe, gpu=True)
            assert gpu.served and "Blackwell" in gpu.kernel and "Marlin" in gpu.kernel


def test_rollout_vllm_is_refused_in_one_line_and_a_dry_run_moves_to_torch(tmp_path):
    import os
    import subprocess
    import sys

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from qarl_cli.commands.train import dry
    from qarl_cli.config.registry import conf_dir, register, validate

    out = subprocess.run([sys.executable, "-m", "qarl_cli.cli", "train", "quant=nvfp4",
                          f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("qarl train: error: rollout=vllm cannot serve quant=nvfp4")
    assert "use rollout=torch" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = validate(compose(config_name="train", overrides=["quant=mxfp4", "device=cpu"]), "train")
    GlobalHydra.instance().clear()
    assert cfg.rollout.name == "vllm" and dry(cfg).rollout.name == "torch"


def test_lowbit_tracking_online_uses_the_shared_global_scale():
    """Raising k_proj's amax changes the global scale q_proj shares with it, so both matrices change: the online
    tracker (quantizing masters) counts what the prequantized one (watching the packed stream) sees."""
    from qarl_cli.quant.checkpoint import quantized_state
    from qarl_cli.quant.select import CheckpointPlan
    from qarl_cli.sync.lowbit_changes import LowbitChanges

    names = ("l.q_proj.weight", "l.k_proj.weight", "l.o_proj.weight")
    plan = CheckpointPlan(frozenset(names), ())
    scheme = nvfp4.NvFp4Scheme(NvFp4Config(), "cpu")
    state = {n: torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) * 0.1 for i, n in enumerate(names)}
    figures = {}
    for mode in ("prequantized", "online"):
        tracker = LowbitChanges(scheme, plan, mode)
        s = {n: t.clone() for n, t in state.items()}
        stream = (lambda: quantized_state(s, scheme, plan)) if mode == "prequantized" else (lambda: iter(s.items()))
        tracker.prime(stream())
        s["l.k_proj.weight"][0, 0] = 5.0  # the group's new amax
        list(tracker.watch(stream()))
        figures[mode] = tracker.commit()
    assert figures["online"] == figures["prequantized"]
    assert figures["online"]["sync/lowbit_changed_tensors"] == 2  # q and k; o has its own global scale
