"""Triton kernels for the hot paths of the quantized forward, each equal bit for bit to its scheme's pure-torch
reference: int8 activations per token, e4m3 activations per group, e4m3 weight blocks, nvfp4 and mxfp4 blocks
(weights and activations), and the fused W4A16
dequant-matmul (equal to the reference wherever fp32 accumulation is exact; elsewhere they differ only in the
order of the sums). The schemes call them for CUDA tensors; CPU tests run them under TRITON_INTERPRET=1, which
must be set before this module is imported.

Rounding is done on the fp32 bit pattern, never by a cast: the interpreter's `.to(tl.float8e4nv)` rounds wrongly,
and a magic-number rounding (y + 1.5 * 2**23) - 1.5 * 2**23 could be contracted into an FMA with the product
before it and round once where the engine rounds twice. Divisions are IEEE (`div_rn`), as in the references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rtne_shift(s, shift):
    """Round-to-nearest-even of s / 2**shift, for int32 s in [0, 2**24] and shift in [1, 31]."""
    q = s >> shift
    rem = s - (q << shift)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def _split_fp32(y):
    """|y|'s unbiased exponent, its 24-bit significand, and y's sign (True: negative)."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    return (mag >> 23) - 127, (mag & 0x7FFFFF) | 0x800000, bits < 0


@triton.jit
def _round_int(y):
    """RTNE of fp32 y, |y| <= 128, to int32. (fp32 zeros and subnormals shift to 0.)"""
    e, s, neg = _split_fp32(y)
    r = _rtne_shift(s, tl.minimum(23 - e, 31))
    return tl.where(neg, -r, r)


@triton.jit
def _e4m3_bits(y):
    """The float8_e4m3fn bit pattern of fp32 y, |y| <= 448, rounded to nearest even. A normal e4m3 keeps 3 of
    the 23 fraction bits (shift 20); below 2**-6 the subnormal step is 2**-9, so the shift grows by one per
    binade. Adding the rounded significand to the exponent field lets a carry (1.111 -> 10.000) bump it."""
    e, s, neg = _split_fp32(y)
    normal = e >= -6
    shift = tl.where(normal, 20, tl.minimum(14 - e, 31))
    code = tl.where(normal, (e + 6) << 3, 0) + _rtne_shift(s, shift)
    return (code | tl.where(neg, 0x80, 0)).to(tl.uint8)


@triton.jit
def _act_quant_int8_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), 127.0), 1e-12)
    inv = tl.math.div_rn(1.0, scale)
    y = tl.minimum(tl.maximum(x * inv, -128.0), 127.0)
    tl.store(q_ptr + row * K + cols, _round_int(y).to(tl.int8), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _act_quant_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < GROUP
    cols = g * GROUP + offs
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-10), 448.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + row * K + cols, _e4m3_bits(y), mask=mask)
    tl.store(s_ptr + row * (K // GROUP) + g, scale)


@triton.jit
def _weight_quant_fp8_kernel(w_ptr, q_ptr, s_ptr, N, K, NB, KB, BN: tl.constexpr, BK: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    mat = tl.program_id(2).to(tl.int64)
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_K)
    rows = bi * BN + r
    cols = bj * BK + c
    mask = ((r < BN) & (rows < N))[:, None] & ((c < BK) & (cols < K))[None, :]
    offs = mat * N * K + rows[:, None] * K + cols[None, :]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.max(tl.abs(w), axis=1), axis=0), 448.0), 1e-12)
    y = tl.minimum(tl.maximum(tl.math.div_rn(w, scale), -448.0), 448.0)
    tl.store(q_ptr + offs, _e4m3_bits(y), mask=mask)
    tl.store(s_ptr + mat * NB * KB + bi * KB + bj, scale)


@triton.jit
def _wna16_matmul_kernel(x_ptr, wp_ptr, s_ptr, y_ptr, M, N, K, KW, GROUP: tl.constexpr, BITS: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    PF: tl.constexpr = 32 // BITS  # values per int32 word (a row's words: KW)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        wmask = (rn < N)[:, None] & kmask[None, :]
        packed = tl.load(wp_ptr + rn[:, None] * KW + (rk // PF)[None, :], mask=wmask, other=0)
        u = (packed >> ((rk % PF) * BITS)[None, :]) & ((1 << BITS) - 1)
        scale = tl.load(s_ptr + rn[:, None] * (K // GROUP) + (rk // GROUP)[None, :], mask=wmask, other=0.0)
        # Dequantize as the reference does: (q * scale) in fp32, rounded once to the compute dtype.
        w = ((u - (1 << (BITS - 1))).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        if IEEE:  # fp32 inputs: no TF32
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _e2m1_code(y):
    """The E2M1 code of fp32 y, |y| <= 6: RTNE by comparisons with the grid's midpoints (a tie goes to the even
    mantissa, hence <= at 0.25, 1.25, 2.5, 5 and < at 0.75, 1.75, 3.5), the sign bit from y's own (so -0 -> 8)."""
    m = tl.abs(y)
    code = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
            + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    neg = y.to(tl.int32, bitcast=True) < 0
    return (code | tl.where(neg, 8, 0)).to(tl.uint8)


@triton.jit
def _e4m3_value(y):
    """fp32 y, 0 <= y <= 448, rounded to its e4m3 value (RTNE through _e4m3_bits), as fp32."""
    code = _e4m3_bits(y).to(tl.int32)
    exp = code >> 3
    man = code & 7
    normal = ((exp + 120) << 23) | (man << 20)  # (1 + man / 8) * 2**(exp - 7)
    return tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))


@triton.jit
def _nvfp4_kernel(x_ptr, q_ptr, s_ptr, g_ptr, K, ROWS_PER_G, stride_x, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """One block of 16: weights (ACT=False, compressed-tensors' rule) or activations (ACT=True, vLLM's)."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    g = tl.load(g_ptr + row // ROWS_PER_G)
    amax = tl.max(tl.abs(x), axis=0)
    if ACT:
        s = _e4m3_value(tl.minimum(g * (amax * 0.16666667163372040), 448.0))  # fp32(1/6), as vLLM multiplies
        safe = tl.where(s == 0.0, 1.0, s)  # both sides of a where are computed: no division by zero
        mult = tl.where(s == 0.0, 0.0, tl.math.div_rn(1.0, safe * tl.math.div_rn(1.0, g)))
        y = x * mult
        tl.store(s_ptr + row * (K // BLOCK) + b, s)
    else:
        s = _e4m3_value(tl.minimum(g * tl.math.div_rn(amax, 6.0), 448.0))
        s = tl.where(s == 0.0, 0.125, s)  # compressed-tensors' stand-in for a zero scale
        y = tl.math.div_rn(x, tl.math.div_rn(s, g))
        tl.store(s_ptr + row * (K // BLOCK) + b, _e4m3_bits(s))
    tl.store(q_ptr + row * K + cols, _e2m1_code(tl.minimum(tl.maximum(y, -6.0), 6.0)))


@triton.jit
def _mxfp4_kernel(x_ptr, q_ptr, e_ptr, K, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    bits = tl.max(tl.abs(x), axis=0).to(tl.int32, bitcast=True)
    e8m0 = tl.minimum(tl.maximum((((bits + 0x200000) & 0x7F800000) >> 23) - 2, 0), 254)
    scale = tl.where(e8m0 > 0, e8m0 << 23, 0x400000).to(tl.float32, bitcast=True)
    y = tl.math.div_rn(x, scale)
    tl.store(q_ptr + row * K + cols, _e2m1_code(tl.minimum(tl.maximum(y, -6.0), 6.0)))
    tl.store(e_ptr + row * (K // BLOCK) + b, e8m0.to(tl.uint8))


def act_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """= int8.quantize_act_ref: int8 [..., K] and fp32 scales [..., 1]."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    q = torch.empty(x2.shape, dtype=torch.int8, device=x.device)
    s = torch.empty((x2.shape[0], 1), dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _act_quant_int8_kernel[(x2.shape[0],)](x2, q, s, k, x2.stride(0), BLOCK=triton.next_power_of_2(k))
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], 1)


def act_quant_fp8_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """= fp8_block.quantize_act_ref: e4m3 [..., K] and fp32 scales [..., K / group]."""
    k = x.shape[-1]
    if k % group:
        raise ValueError(f"the last dimension ({k}) must be a multiple of the group size {group}")
    x2 = x.reshape(-1, k).contiguous()
    q = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty((x2.shape[0], k // group), dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _act_quant_fp8_kernel[(x2.shape[0], k // group)](x2, q, s, k, x2.stride(0), GROUP=group,
                                                         BLOCK=triton.next_power_of_2(group))
    return q.view(torch.float8_e4m3fn).reshape(x.shape), s.reshape(*x.shape[:-1], k // group)


def weight_quant_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> dict:
    """= fp8_block.quantize_weight_ref for w [..., N, K]."""
    *lead, n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    w3 = w.reshape(-1, n, k).contiguous()
    q = torch.empty(w3.shape, dtype=torch.uint8, device=w.device)
    s = torch.empty((w3.shape[0], nb, kb), dtype=torch.float32, device=w.device)
    _weight_quant_fp8_kernel[(nb, kb, w3.shape[0])](
        w3, q, s, n, k, nb, kb, BN=bn, BK=bk, BLOCK_N=triton.next_power_of_2(bn),
        BLOCK_K=triton.next_power_of_2(bk))
    return {"weight": q.view(torch.float8_e4m3fn).reshape(w.shape), "weight_scale_inv": s.reshape(*lead, nb, kb)}


def wna16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int, bits: int = 4
                 ) -> torch.Tensor:
    """x [..., K] @ dequantized W^T, W given as wna16's weight_packed [N, ceil(K / (32 // bits))] and
    weight_scale [N, K/group]."""
    k = x.shape[-1]
    n = packed.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = 32, 64, 64
    if m:
        _wna16_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, packed.contiguous(), scale.contiguous(), y, m, n, k, packed.shape[-1], GROUP=group, BITS=bits,
            BM=bm, BN=bn, BK=bk, IEEE=x.dtype == torch.float32)
    return y.reshape(*x.shape[:-1], n)


def _fp4_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"the last dimension ({k}) must be a multiple of the block size {block}")
    return x.reshape(-1, k).contiguous()


def weight_quant_nvfp4(w: torch.Tensor, amax: "torch.Tensor | None" = None) -> dict:
    """= nvfp4.quantize_weight_ref for w [..., N, K] (the global scale from the same torch code)."""
    from qarl_cli.quant.fp4 import global_scale, pack_e2m1

    *lead, n, k = w.shape
    amax = w.float().abs().amax((-2, -1)) if amax is None else amax.float()
    g = global_scale(amax).reshape(-1).expand(max(1, w.numel() // (n * k))).contiguous()
    w2 = _fp4_rows(w, 16)
    q = torch.empty(w2.shape, dtype=torch.uint8, device=w.device)
    s = torch.empty((w2.shape[0], k // 16), dtype=torch.uint8, device=w.device)
    if w2.shape[0]:
        _nvfp4_kernel[(w2.shape[0], k // 16)](w2, q, s, g, k, n, w2.stride(0), ACT=False, BLOCK=16)
    return {"weight_packed": pack_e2m1(q.reshape(w.shape)),
            "weight_scale": s.view(torch.float8_e4m3fn).reshape(*lead, n, k // 16),
            "weight_global_scale": g.reshape(*lead, 1) if lead else g[:1].clone()}


def act_quant_nvfp4(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """= nvfp4.quantize_act_ref: uint8 codes [..., K] and fp32 block scales [..., K / 16]."""
    k = x.shape[-1]
    x2 = _fp4_rows(x, 16)
    q = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    s = torch.empty((x2.shape[0], k // 16), dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        _nvfp4_kernel[(x2.shape[0], k // 16)](x2, q, s, g.float().reshape(1).contiguous(), k, x2.shape[0],
                                              x2.stride(0), ACT=True, BLOCK=16)
    return q.reshape(x.shape), s.reshape(*x.shape[:-1], k // 16)


def quant_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """= mxfp4.quantize_ref: uint8 codes [..., K] and uint8 E8M0 scales [..., K / 32]."""
    k = x.shape[-1]
    x2 = _fp4_rows(x, 32)
    q = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    e = torch.empty((x2.shape[0], k // 32), dtype=torch.uint8, device=x.device)
    if x2.shape[0]:
        _mxfp4_kernel[(x2.shape[0], k // 32)](x2, q, e, k, x2.stride(0), BLOCK=32)
    return q.reshape(x.shape), e.reshape(*x.shape[:-1], k // 32)
