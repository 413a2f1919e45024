"""Quantization references against values derived by hand or from the formats' bit layouts, never from the code
under test: RTNE on ties, every e4m3 value / midpoint / neighbour, int4 packing, one small case per scheme."""

import math

import pytest
import torch

from qarl_cli.config.quant import Fp8BlockConfig, Int8Config, W4A16Config, WNA16Config
from qarl_cli.quant import fp8_block, int8, numerics, wna16
from qarl_cli.quant.int8 import Int8Scheme
from qarl_cli.quant.wna16 import W4A16Scheme, WNA16Scheme


def e4m3_value(code: int) -> float:
    """float8_e4m3fn from its bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0:
        return sign * m / 8 * 2.0 ** -6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def e4m3_cases() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the expected RTNE codes: all 127 non-negative finite values (0..448), every midpoint between
    neighbours (ties go to the even code), the fp32 neighbours of both, values past 448 (saturate), mirrored."""
    values = [e4m3_value(c) for c in range(0x7F)]
    xs, codes = [], []
    for c, v in enumerate(values):
        t = torch.tensor(v, dtype=torch.float32)
        xs += [t, torch.nextafter(t, torch.tensor(math.inf)), torch.nextafter(t, torch.tensor(-math.inf))]
        codes += [c, c, c]
        if c + 1 < len(values):
            mid = torch.tensor((v + values[c + 1]) / 2, dtype=torch.float32)
            assert mid.item() == (v + values[c + 1]) / 2  # exact in fp32
            xs += [mid, torch.nextafter(mid, torch.tensor(math.inf)), torch.nextafter(mid, torch.tensor(-math.inf))]
            codes += [c if c % 2 == 0 else c + 1, c + 1, c]
    for big in (448.5, 460.0, 464.0, 479.0, 1e6):
        xs.append(torch.tensor(big))
        codes.append(0x7E)
    x = torch.stack(xs)
    code = torch.tensor(codes)
    # The fp32 neighbour below +0 is -2**-149: it rounds to -0, code 0x80 | 0.
    negative = x < 0
    code = torch.where(negative, code | 0x80, code)
    return torch.cat([x, -x]), torch.cat([code, code ^ 0x80]).to(torch.uint8)


def test_e4m3_table_is_the_format():
    assert e4m3_value(0x7E) == 448.0 and e4m3_value(0x01) == 2.0 ** -9 and e4m3_value(0x08) == 2.0 ** -6
    assert e4m3_value(0x38) == 1.0 and e4m3_value(0xB8) == -1.0


def test_round_e4m3_every_value_midpoint_and_neighbour():
    x, expected = e4m3_cases()
    got = numerics.round_e4m3(x).view(torch.uint8)
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), hex(got[i].item()), hex(expected[i].item())) for i in bad[:10]]


def test_round_int_ties_to_even_and_saturates():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -127.5, 200.0, 3.49999])
    assert numerics.round_int(x, -127, 127).tolist() == [0, 2, 2, 0, -2, -2, 126, 127, -127, 127, 3]


def test_int8_weight_per_channel_by_hand():
    # amax 1, weight_qmax 64: scale 1/64 exactly, so q = RTNE(64 w): -32.5 -> -32, 33.5 -> 34, 0.5 -> 0.
    w = torch.tensor([[1.0, -32.5 / 64, 33.5 / 64, 0.5 / 64], [0.0, 0.0, 0.0, 0.0]])
    packed = Int8Scheme(Int8Config(weight_qmax=64), "cpu").quantize(w)
    assert packed["weight"].dtype == torch.int8
    assert packed["weight"].tolist() == [[64, -32, 34, 0], [0, 0, 0, 0]]
    floor = torch.tensor(numerics.SCALE_FLOOR, dtype=torch.float32).item()
    assert packed["weight_scale"].tolist() == [[1 / 64], [floor]]


def test_int8_weight_range_follows_the_engine():
    assert int8.engine_weight_qmax(100, "cpu") == 100
    assert int8.engine_weight_qmax(None, "cuda") == 127
    caps = torch.cpu.get_capabilities()
    saturating = caps.get("architecture") == "x86_64" and not any(
        caps.get(f) for f in ("avx512_vnni", "avx_vnni", "amx_int8"))
    assert int8.engine_weight_qmax(None, "cpu") == (64 if saturating else 127)
    assert 2 * 255 * 64 <= 32767 < 2 * 255 * 65  # oneDNN's u8 x s8 pair sums fit int16 up to |q| = 64


def test_int8_activation_per_token_by_hand():
    # amax 127: scale 1, so q = RTNE(x); a zero row gets q = 0 and a positive scale.
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5], [0.0, 0.0, 0.0, 0.0]])
    q, s = int8.quantize_act_ref(x)
    assert q.tolist() == [[127, 0, 2, -2], [0, 0, 0, 0]]
    assert s[0].item() == 1.0 and s[1].item() > 0


def test_int8_activation_multiplies_by_the_reciprocal():
    # The CPU engine computes x * (1 / scale), which differs from x / scale at a few rounding boundaries: check
    # the definition on many values against an fp64 construction of the same steps (test_quant_vllm checks it
    # against the engine's own op).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * 3
    q, s = int8.quantize_act_ref(x)
    amax = x.abs().amax(-1, keepdim=True)
    scale = (amax.double() / 127).float()  # correctly rounded fp32 division
    inv = (1 / scale.double()).float()
    assert torch.equal(s, scale)
    assert torch.equal(q, torch.round(x * inv).clamp(-128, 127).to(torch.int8))


def test_fp8_weight_block_by_hand():
    # A 130 x 130 weight: four blocks (the last ones partial). Block (0, 0) has amax 448 -> scale 1, q = e4m3(w).
    w = torch.zeros(130, 130)
    w[0, 0], w[1, 1], w[2, 2] = 448.0, 0.3, -17.0  # 0.3 -> 0.3125; -17 is a tie between -16 and -18 -> -16
    w[129, 129] = 2.0 * 448  # block (1, 1): scale 2
    w[128, 0] = 1e-3  # block (1, 0): amax 1e-3
    packed = fp8_block.quantize_weight_ref(w, (128, 128))
    s = packed["weight_scale_inv"]
    assert s.shape == (2, 2) and s.dtype == torch.float32
    floor = torch.tensor(numerics.SCALE_FLOOR, dtype=torch.float32).item()
    assert s[0, 0].item() == 1.0 and s[1, 1].item() == 2.0 and s[0, 1].item() == floor
    assert packed["weight"].dtype == torch.float8_e4m3fn
    q = packed["weight"].float()
    assert q[0, 0].item() == 448 and q[1, 1].item() == 0.3125 and q[2, 2].item() == -16.0
    assert q[129, 129].item() == 448 and q[128, 0].item() == 448  # each block's amax maps to 448
    deq = fp8_block.Fp8BlockScheme(Fp8BlockConfig(), "cpu").dequantize(packed, torch.float32)
    assert deq[129, 129].item() == 896 and deq[2, 2].item() == -16.0


def test_fp8_activation_groups_by_hand():
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1] = 448.0, 0.3  # group 0: scale 1
    x[0, 128] = 4.48  # group 1: scale 0.01 -> x / 0.01 = 448
    q, s = fp8_block.quantize_act_ref(x, 128)
    assert s.shape == (2, 2)
    assert s[0, 0].item() == 1.0 and s[0, 1].item() == torch.tensor(4.48 / 448, dtype=torch.float32).item()
    assert s[1, 0].item() == torch.tensor(1e-10 / 448, dtype=torch.float32).item()  # vLLM's amax floor
    assert q[0, 1].float().item() == 0.3125 and q[0, 128].float().item() == 448.0


def test_int4_pack_by_hand_and_against_compressed_tensors():
    # group of 8 with amax 7: scale 1, q = RTNE(w): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -3.5 -> -4, 6.5 -> 6.
    w = torch.tensor([[7.0, -7.0, 0.5, 1.5, 2.5, -3.5, 0.0, 6.5]])
    packed = wna16.quantize_weight_ref(w, 8)
    # nibbles q + 8, first element lowest: F 1 8 A A 4 8 E -> 0xE84AA81F as a two's complement int32
    assert packed["weight_packed"].dtype == torch.int32
    assert packed["weight_packed"].tolist() == [[0xE84AA81F - (1 << 32)]]
    assert packed["weight_scale"].tolist() == [[1.0]]
    assert wna16.unpack(packed["weight_packed"], 4, 8).tolist() == [[7, -7, 0, 2, 2, -4, 0, 6]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [64, 72])
def test_every_width_packs_as_compressed_tensors_does(bits, k):
    """pack / unpack against compressed-tensors' own pack_to_int32 / unpack_from_int32, at every width and at a
    K that fills no whole word at 3 bits (64 and 72: 7 and 8 words, the last padded) nor, for 72, at 2 bits."""
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    lo, hi = wna16.qrange(bits)
    assert (lo, hi) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(lo, hi + 1, (16, k), generator=g, dtype=torch.int8)
    ours = wna16.pack(q, bits)
    assert torch.equal(ours, ct.pack_to_int32(q, bits))
    assert torch.equal(ct.unpack_from_int32(ours, bits, torch.Size([16, k])), q)
    assert torch.equal(wna16.unpack(ours, bits, k), q)


def test_three_bits_by_hand():
    """3 bits: q + 4 in bits 3j..3j+2 of the word, ten to a word, the top two bits zero. A group of 8 with amax 3
    (scale 1): q = RTNE(w) = [3, -3, 0, 2, 2, -2, 0, 1] (ties to even); codes 7 1 4 6 6 2 4 5."""
    w = torch.tensor([[3.0, -3.0, 0.4, 1.5, 2.5, -2.5, -0.5, 1.2]])
    packed = wna16.quantize_weight_ref(w, 8, bits=3)
    codes = [7, 1, 4, 6, 6, 2, 4, 5]
    assert packed["weight_scale"].tolist() == [[1.0]]
    assert packed["weight_packed"].tolist() == [[sum(c << (3 * j) for j, c in enumerate(codes))]]
    assert wna16.unpack(packed["weight_packed"], 3, 8).tolist() == [[3, -3, 0, 2, 2, -2, 0, 1]]


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_fewer_bits_mean_a_coarser_grid_with_the_same_rule(bits):
    """scale = amax / qmax rounded to the scale dtype, q = RTNE(w / scale) clamped to the width's range, the
    dequantized weight q * scale: by hand, for each width; the relative error falls as the width grows."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 256, generator=g) * 0.05
    scheme = WNA16Scheme(WNA16Config(bits=bits, scale_dtype="float32"), "cpu")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    s = (w.reshape(8, 2, 128).abs().amax(-1) / hi).repeat_interleave(128, -1)
    q = torch.round(w / s).clamp(lo, hi)
    assert torch.equal(scheme.fake_quant_weight(w), q * s)
    errors = [(WNA16Scheme(WNA16Config(bits=b, scale_dtype="float32"), "cpu").fake_quant_weight(w) - w).norm()
              for b in (2, 3, 4, 8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 30


@pytest.mark.parametrize("scale_dtype", ["float16", "bfloat16"])
def test_w4a16_scale_is_rounded_to_the_scale_dtype_first_whatever_the_weights_dtype(scale_dtype):
    """A checkpoint written from bf16-stored weights and a sync from the same weights held as fp32 masters must
    hold the same int4 values: with each scale rounded to its weights' own dtype they did not, and a push of
    unchanged weights moved SmolLM2's W4A16 engine by up to 3.5 in logprob."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(8, 256, generator=g) * 0.05).bfloat16()
    dt = getattr(torch, scale_dtype)
    scheme = W4A16Scheme(W4A16Config(scale_dtype=scale_dtype), "cpu")
    stored, masters = scheme.quantize(w), scheme.quantize(w.float())
    assert all(torch.equal(stored[k], masters[k]) for k in stored)
    assert stored["weight_scale"].dtype == dt and stored["weight_scale"].shape == (8, 2)
    # by hand: amax / 7 rounded to the scale dtype, q = RTNE(w / scale) within [-8, 7]
    s = (w.float().reshape(8, 2, 128).abs().amax(-1) / 7).to(dt).float().repeat_interleave(128, -1)
    q = wna16.unpack(stored["weight_packed"], 4, 256).float()
    assert torch.equal(q, torch.round(w.float() / s).clamp(-8, 7))
    assert torch.equal(scheme.dequantize(stored, torch.float32), q * s)


_EPYC = "avx2 fma f16c avx512f avx512_vnni avx512_bf16"  # AVX-512: vLLM's library there has the W4A16 GEMM


@pytest.mark.parametrize("flags, served, expected", [
    (_EPYC, "float16", torch.float16),  # vLLM ran its W4A16 GEMM in fp16 only
    (_EPYC, "bfloat16,float16", torch.bfloat16),  # both: bf16, native on this kind
    (_EPYC, "", torch.bfloat16),  # in neither: no engine to follow
    ("avx2 fma f16c", "float16", torch.bfloat16),  # AVX2's library has no W4A16 GEMM: the probe is not asked
], ids=["serves-fp16", "serves-both", "serves-none", "avx2-library"])
def test_w4a16_default_scale_dtype_is_the_engines(monkeypatch, flags, served, expected):
    """Every branch on every CPU (the CPU's flags and the probe's answer forced): the dtype vLLM's W4A16 kernel
    runs in here, else bf16; a GPU engine holds scales in the presets' bf16."""
    from qarl_cli.machine.capabilities import FLAGS_ENV
    from qarl_cli.machine.capabilities_probe import DTYPES_ENV

    monkeypatch.setenv(FLAGS_ENV, flags)
    monkeypatch.setenv(DTYPES_ENV, served)
    assert W4A16Scheme(W4A16Config(), "cpu").scale_dtype() == expected
    assert W4A16Scheme(W4A16Config(), "cuda").scale_dtype() == torch.bfloat16
    assert W4A16Scheme(W4A16Config(scale_dtype="float32"), "cpu").scale_dtype() == torch.float32


def test_a_group_size_that_does_not_divide_the_model_is_one_line_with_one_that_does():
    """SmolLM2's linears are 576 wide: groups of 128 do not fit, 64 do (a config error, not a traceback)."""
    from qarl_cli.config.errors import ConfigError

    scheme = W4A16Scheme(W4A16Config(group_size=128), "cpu")
    with pytest.raises(ConfigError, match=r"quant.group_size=128 does not divide .* \(576\).*use quant.group_size=64"):
        scheme.quantize(torch.randn(32, 576))
    assert W4A16Scheme(W4A16Config(group_size=64), "cpu").quantize(torch.randn(32, 576))["weight_scale"].shape == (32, 9)

