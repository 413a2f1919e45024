"""The Triton kernels equal the pure-torch references bit for bit. Without CUDA they run on CPU tensors under
TRITON_INTERPRET=1 (set for this module only, before the kernels are imported); with CUDA they run compiled on
CUDA tensors (the `gpu` tests)."""

import os

import pytest
import torch

from qarl_cli.config.quant import WNA16Config
from qarl_cli.quant import fp8_block, int8, mxfp4, nvfp4, wna16
from test_quant_numerics import e4m3_cases

CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] if CUDA else ["cpu"]
INTERPRET = {} if CUDA else {"TRITON_INTERPRET": "1"}
_saved = {k: os.environ.get(k) for k in INTERPRET}


def _restore():
    for k, v in _saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


os.environ.update(INTERPRET)  # read when the kernels are decorated (this import) and when they launch
triton_kernels = pytest.importorskip("qarl_cli.quant.triton_kernels")
_restore()  # the rest of the session (vLLM included) keeps the environment it started with


@pytest.fixture(autouse=True, scope="module")
def _interpreter():
    os.environ.update(INTERPRET)
    yield
    _restore()


def _x(shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 5
    x[0, :7] = torch.tensor([0.5, -1.5, 2.5, 1e-30, -0.0, 3e-39, 0.0])  # ties, tiny, -0, an fp32 subnormal
    x[1] = 0.0  # an all-zero token
    return x.to(device=device, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activation_per_token(device, dtype):
    x = _x((33, 200), device, dtype)
    q, s = triton_kernels.act_quant_int8(x)
    q_ref, s_ref = int8.quantize_act_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_activation_per_group(device, dtype):
    x = _x((17, 384), device, dtype)
    q, s = triton_kernels.act_quant_fp8_group(x, 128)
    q_ref, s_ref = fp8_block.quantize_act_ref(x, 128)
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_rounding_of_every_value_midpoint_and_neighbour(device):
    """The hand-rolled e4m3 rounding on the table built from the bit layout: 127 cases per group of 128 and a
    448, so that every group's scale is exactly 1 and the kernel rounds the cases themselves (hence only
    |x| <= 448: a larger value would set the scale)."""
    x, expected = e4m3_cases()
    keep = x.abs() <= 448
    x, expected = x[keep], expected[keep]
    rows = -(-x.numel() // 127)
    groups = torch.full((rows, 128), 448.0)
    groups[:, :127] = torch.cat([x, torch.zeros(rows * 127 - x.numel())]).reshape(rows, 127)
    q, s = triton_kernels.act_quant_fp8_group(groups.to(device), 128)
    assert torch.all(s == 1.0)
    got = _bits(q)[:, :127].reshape(-1)[: x.numel()].cpu()
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), hex(got[i].item()), hex(expected[i].item())) for i in bad[:10]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_weight_blocks(device, dtype):
    w = _x((2 * 200, 300), device, dtype).reshape(2, 200, 300)  # two matrices, partial blocks on both axes
    got = triton_kernels.weight_quant_fp8_block(w, (128, 128))
    ref = fp8_block.quantize_weight_ref(w, (128, 128))
    assert torch.equal(_bits(got["weight"]), _bits(ref["weight"]))
    assert torch.equal(got["weight_scale_inv"], ref["weight_scale_inv"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_wna16_matmul_exact_where_fp32_sums_are_exact(device, bits):
    """Small integer activations and power-of-two scales: every product and partial sum is exact in fp32, so
    the fused kernel must equal dequantize-then-matmul bit for bit; with random data only the order of the
    fp32 sums differs. 3 bits: ten values to a word, each row's last word padded (K = 256)."""
    g = torch.Generator().manual_seed(bits)
    n, k = 96, 256
    lo, hi = wna16.qrange(bits)
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    scale = 2.0 ** torch.randint(-3, 3, (n, k // 128), generator=g).float()
    packed = {"weight_packed": wna16.pack(q, bits).to(device), "weight_scale": scale.to(device)}
    assert packed["weight_packed"].shape == (n, -(-k // (32 // bits)))
    scheme = wna16.WNA16Scheme(WNA16Config(bits=bits), "cpu")
    assert torch.equal(scheme.values(packed).cpu(), q)
    x = torch.randint(-4, 5, (37, k), generator=g).float().to(device)
    y = triton_kernels.wna16_matmul(x, packed["weight_packed"], packed["weight_scale"], 128, bits)
    assert torch.equal(y, x @ scheme.dequantize(packed, torch.float32).t())
    x = torch.randn(5, k, generator=g).to(device)
    y = triton_kernels.wna16_matmul(x, packed["weight_packed"], packed["weight_scale"], 128, bits)
    torch.testing.assert_close(y, x @ scheme.dequantize(packed, torch.float32).t(), rtol=1e-4, atol=1e-4)


def _fp4_cases(device, dtype, seed):
    """_x's rows plus blocks of E2M1 midpoints and grid values at scale 1, and a block of fp32 subnormals."""
    x = _x((12, 256), device, torch.float32, seed)
    x[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                              -5.0, 0.5])
    x[3, :32] = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4)
    x[4, :32] = 1e-40
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_weights_and_activations(device, dtype):
    x = _fp4_cases(device, dtype, 3)
    w = x.reshape(2, 6, 256)  # two matrices, a global scale each
    got, ref = triton_kernels.weight_quant_nvfp4(w), nvfp4.quantize_weight_ref(w)
    assert torch.equal(got["weight_packed"], ref["weight_packed"])
    assert torch.equal(_bits(got["weight_scale"]), _bits(ref["weight_scale"]))
    assert torch.equal(got["weight_global_scale"], ref["weight_global_scale"])
    amax = torch.tensor(7.5, device=device)  # a fused group's amax
    got, ref = triton_kernels.weight_quant_nvfp4(x, amax), nvfp4.quantize_weight_ref(x, amax)
    assert all(torch.equal(_bits(got[k]), _bits(ref[k])) for k in ref)
    for g in (1.0, 134.4, 2688.0 / 3e-3):  # the static input global scale of input_amax 2688, 20 and 3e-3
        g = torch.tensor(g, device=device)
        (q, s), (q_ref, s_ref) = triton_kernels.act_quant_nvfp4(x, g), nvfp4.quantize_act_ref(x, g)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_blocks(device, dtype):
    x = _fp4_cases(device, dtype, 4)
    x[5, :32] = torch.tensor([7.0, 6.9, 1.75, -3.0] * 8)  # amax rounding up a binade
    (q, e), (q_ref, e_ref) = triton_kernels.quant_mxfp4(x), mxfp4.quantize_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(e, e_ref)


@pytest.mark.gpu
def test_schemes_dispatch_to_triton_on_cuda():
    """On CUDA the schemes call the kernels; the results still equal the CPU references."""
    from qarl_cli.config.quant import Fp8BlockConfig, Int8Config, MxFp4Config, NvFp4Config

    x = _x((9, 256), "cuda")
    q, s = int8.Int8Scheme(Int8Config(), "cuda").quantize_act(x)
    q_ref, s_ref = int8.quantize_act_ref(x.cpu())
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    scheme = fp8_block.Fp8BlockScheme(Fp8BlockConfig(), "cuda")
    got = scheme.quantize(x)
    ref = fp8_block.quantize_weight_ref(x.cpu(), (128, 128))
    assert torch.equal(_bits(got["weight"]).cpu(), _bits(ref["weight"]))
    got = nvfp4.NvFp4Scheme(NvFp4Config(), "cuda").quantize(x)
    ref = nvfp4.quantize_weight_ref(x.cpu())
    assert all(torch.equal(_bits(got[k]).cpu(), _bits(ref[k])) for k in ref)
    q, e = mxfp4.MxFp4Scheme(MxFp4Config(), "cuda").quantize_act(x)
    assert all(torch.equal(a.cpu(), b) for a, b in zip((q, e), mxfp4.quantize_ref(x.cpu())))
