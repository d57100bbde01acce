"""Rotary embedding fused with the KV-cache write, for decode and verify steps: one launch takes the fused q/k/v
projection's output to rotated queries and to rotated keys and values stored at their cache slots (unfused, a
compiled step spent three element-wise kernels a layer on this: ~3.4 us a layer of a 1.8 ms 1.5B step on the
H200).

    _rope_write_kernel  grid (B * T, Hq + 2 Hkv): program (token, head) — query heads rotate into q, key heads
                        rotate into the key cache at the token's slot, value heads copy into the value cache

    rope_write(qkv [B, T, (Hq + 2 Hkv) · D], cos, sin [B, 1, T, D], positions [B, T], k_cache, v_cache
               [B, Hkv, S, D], heads=Hq) -> q [B, Hq, T, D]; qkv, cos, sin and the caches of one dtype (fp32, bf16,
               fp16); D a power of two. Slots outside [0, S) are not written.

Rounding: each product and the sum rounded to the dtype as eager torch rounds `x · cos + rotate_half(x) · sin`
(`models.rope.apply_rope`), so the result equals the reference bitwise. Launches depend on shapes alone:
capturable in a CUDA graph. `rope_write_ref` is the torch reference (what the model computes without it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import chained, wait_inputs

from ..models.rope import apply_rope

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """fp32 x rounded to the nearest `dtype` value, ties to even (as fp32): what a cast does on the GPU, but Triton's
    CPU interpreter truncates casts to bf16, so bf16 rounds here by its bits (finite x)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rope_write_kernel(qkv, cos, sin, positions, q_out, k_cache, v_cache, T, S, stride_xb, stride_xt, stride_cb,
                       stride_ct, stride_pb, stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks,
                       stride_vb, stride_vh, stride_vs, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       PDL: tl.constexpr):
    wait_inputs(PDL)
    token = tl.program_id(0)
    h = tl.program_id(1)  # [0, HQ): a query head; [HQ, HQ + HKV): a key head; then a value head
    b = (token // T).to(tl.int64)
    t = token % T
    d = tl.arange(0, D)
    src = qkv + b * stride_xb + t * stride_xt + h * D
    slot = tl.load(positions + b * stride_pb + t).to(tl.int64)
    if h < HQ + HKV:
        x = tl.load(src + d)
        half: tl.constexpr = D // 2
        partner = tl.load(src + (d + half) % D).to(tl.float32)
        rotated = tl.where(d < half, -partner, partner)  # rotate_half(x), exact in fp32
        c = tl.load(cos + b * stride_cb + t * stride_ct + d)
        s = tl.load(sin + b * stride_cb + t * stride_ct + d)
        # each op rounded to the dtype as eager torch rounds it (and no fused multiply-add: see the launch)
        prod_c = _rounded(x.to(tl.float32) * c.to(tl.float32), x.dtype)
        prod_s = _rounded(rotated * s.to(tl.float32), x.dtype)
        y = _rounded(prod_c + prod_s, x.dtype).to(x.dtype)
        if h < HQ:
            tl.store(q_out + b * stride_qb + h * stride_qh + t * stride_qt + d, y)
        elif (slot >= 0) & (slot < S):
            tl.store(k_cache + b * stride_kb + (h - HQ) * stride_kh + slot * stride_ks + d, y)
    elif (slot >= 0) & (slot < S):
        tl.store(v_cache + b * stride_vb + (h - HQ - HKV) * stride_vh + slot * stride_vs + d, tl.load(src + d))


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
    """qkv [B, T, (heads + 2 Hkv) · D] (the fused projection's output), cos, sin [B, 1, T, D], positions [B, T] int
    -> q [B, heads, T, D] rotated; the rotated keys and the values written into k_cache, v_cache [B, Hkv, S, D] at
    slots `positions`."""
    B, T, width = qkv.shape
    _, Hkv, S, D = k_cache.shape
    if (width != (heads + 2 * Hkv) * D or D & (D - 1) or D < 2 or qkv.dtype not in _DTYPES
            or not all(x.dtype == qkv.dtype for x in (cos, sin, k_cache, v_cache)) or v_cache.shape != k_cache.shape
            or cos.shape != (B, 1, T, D) or sin.shape != cos.shape or positions.shape != (B, T)):
        raise ValueError(f"rope_write needs qkv [B, T, (Hq + 2 Hkv) D], cos/sin [B, 1, T, D], positions [B, T] and "
                         f"caches [B, Hkv, S, D] of one dtype, D a power of two; got qkv {list(qkv.shape)} "
                         f"{qkv.dtype}, cos {list(cos.shape)}, positions {list(positions.shape)}, caches "
                         f"{list(k_cache.shape)} {k_cache.dtype}")
    assert qkv.stride(-1) == cos.stride(-1) == sin.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert cos.stride() == sin.stride()
    q = torch.empty(B, heads, T, D, dtype=qkv.dtype, device=qkv.device)
    if B * T:
        _rope_write_kernel[(B * T, heads + 2 * Hkv)](
            qkv, cos, sin, positions, q, k_cache, v_cache, T, S, qkv.stride(0), qkv.stride(1), cos.stride(0),
            cos.stride(2), positions.stride(0), q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            HQ=heads, HKV=Hkv, D=D, num_warps=1, enable_fp_fusion=False, **chained(qkv.device))
    return q


def rope_write_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> torch.Tensor:
    """The torch reference of `rope_write`: split, `apply_rope`, the cache's indexed write."""
    B, T, _ = qkv.shape
    _, Hkv, S, D = k_cache.shape
    q, k, v = qkv.view(B, T, heads + 2 * Hkv, D).transpose(1, 2).split((heads, Hkv, Hkv), dim=1)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rows, cols = ((positions >= 0) & (positions < S)).nonzero(as_tuple=True)
    slots = positions[rows, cols]
    k_cache[rows, :, slots] = k[rows, :, cols]
    v_cache[rows, :, slots] = v[rows, :, cols]
    return q.contiguous()
