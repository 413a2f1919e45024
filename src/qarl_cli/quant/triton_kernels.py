"""Triton kernels for the hot paths of the quantized forward, each equal bit for bit to its scheme's pure-torch
reference: int8 activations per token, e4m3 activations per group, e4m3 weight blocks, and the fused W4A16
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
def _w4a16_matmul_kernel(x_ptr, wp_ptr, s_ptr, y_ptr, M, N, K, GROUP: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
        wmask = (rn < N)[:, None] & kmask[None, :]
        packed = tl.load(wp_ptr + rn[:, None] * (K // 8) + (rk // 8)[None, :], mask=wmask, other=0)
        nib = (packed >> ((rk % 8) * 4)[None, :]) & 0xF
        scale = tl.load(s_ptr + rn[:, None] * (K // GROUP) + (rk // GROUP)[None, :], mask=wmask, other=0.0)
        # Dequantize as the reference does: (q * scale) in fp32, rounded once to the compute dtype.
        w = ((nib - 8).to(tl.float32) * scale.to(tl.float32)).to(x.dtype)
        if IEEE:  # fp32 inputs: no TF32
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


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


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] @ dequantized W^T, W given as w4a16's weight_packed [N, K/8] and weight_scale [N, K/group]."""
    k = x.shape[-1]
    n = packed.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bm, bn, bk = 32, 64, 64
    if m:
        _w4a16_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            x2, packed.contiguous(), scale.contiguous(), y, m, n, k, GROUP=group, BM=bm, BN=bn, BK=bk,
            IEEE=x.dtype == torch.float32)
    return y.reshape(*x.shape[:-1], n)
