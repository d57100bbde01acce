"""BinaryPC kernels: the quantised probe as bit-planes, popcount scoring with the group max fused in, and the
residual sign encoding of keys. Each has its torch reference (`*_ref`), which is also the CPU path.

    probe   q [B, Hq, D], basis [B, Hkv, b, D] fp32 -> planes [B*Hkv, G, 1 + m, W] int64, l1 [B*Hkv, G] int64
            (plane 0: the probe's sign bits; plane 1 + j: bit j of |p̃|; l1 = Σ|p̃| per query head)
    score   codes [B, Hkv, S, W] int64, planes, l1, positions [B] -> keys [B*Hkv, S] int16/int32
            key = max over the group of Σ_i p̃_i h_i, plus an offset that makes every key >= 1 (0 = never attend)
    encode  keys [B, Hkv, S, D], basis -> codes [B, Hkv, S, W] int64 and reconstruction error [B, Hkv, S] fp32
            of the slots [start[b], end[b]) of each row

With h_i = ±1 and p̃_i = s_i m_i: p̃_i h_i = m_i (1 − 2 x_i), x = code XOR sign bits, so
Σ_i p̃_i h_i = Σ|p̃| − 2 Σ_j 2^j popcount(M_j AND x) over the magnitude bit-planes M_j. The score kernel reads
the codes (8 bytes a slot at 64 bits) and writes one key per slot and KV head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import interpreting
from ..attention.binarypc import encode, pack_bits, popcount, quantize_probe


def key_range(bits: int, magnitude_bits: int) -> tuple[int, int]:
    """(offset that makes the lowest score 1, key bits: 16 when the keys fit int16's 15 value bits, else 32)."""
    offset = ((1 << magnitude_bits) - 1) * bits + 1
    return offset, 16 if 2 * offset < (1 << 15) else 32


# ---------------------------------------------------------------------------------------------- probe

@triton.jit
def _round_half_even(x):
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


@triton.jit
def _probe_kernel(q_ptr, basis_ptr, planes_ptr, l1_ptr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  W: tl.constexpr, M: tl.constexpr):
    r = tl.program_id(0)  # (row, KV head); its query heads are r * G .. r * G + G - 1
    i = tl.arange(0, 64)
    d = tl.arange(0, D)
    top = (1 << M) - 1
    scale = 0.0
    for w in tl.static_range(W):  # the scale: max |probe| over the group and every bit
        basis = tl.load(basis_ptr + (r * BITS + w * 64 + i)[:, None] * D + d[None, :],
                        mask=(w * 64 + i < BITS)[:, None], other=0.0)  # [64, D]
        for g in tl.static_range(G):
            qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)
            scale = tl.maximum(scale, tl.max(tl.abs(tl.sum(basis * qg[None, :], 1)), 0))
    scale = tl.maximum(scale, 1e-30)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)
        l1 = 0
        for w in tl.static_range(W):
            live = w * 64 + i < BITS
            basis = tl.load(basis_ptr + (r * BITS + w * 64 + i)[:, None] * D + d[None, :], mask=live[:, None],
                            other=0.0)
            p = _round_half_even(tl.math.div_rn(tl.sum(basis * qg[None, :], 1), scale) * top).to(tl.int64)  # [64]
            mag = tl.abs(p)
            l1 += tl.sum(tl.where(live, mag, 0), 0)
            base = planes_ptr + ((r * G + g) * (1 + M)) * W + w
            one = tl.full([64], 1, tl.int64) << i.to(tl.int64)
            tl.store(base, tl.sum(tl.where(live & (p >= 0), one, 0), 0))
            for j in tl.static_range(M):
                tl.store(base + (1 + j) * W, tl.sum(tl.where(live & (((mag >> j) & 1) == 1), one, 0), 0))
        tl.store(l1_ptr + r * G + g, l1)


def probe_planes(q: torch.Tensor, basis: torch.Tensor, magnitude_bits: int):
    """q [B, Hq, D] (any float dtype), basis [B, Hkv, b, D] fp32 -> (planes [B*Hkv, G, 1 + m, W] int64,
    l1 [B*Hkv, G] int64)."""
    B, Hq, D = q.shape
    _, Hkv, bits, _ = basis.shape
    G, W, R = Hq // Hkv, -(-bits // 64), B * Hkv
    planes = torch.empty(R, G, 1 + magnitude_bits, W, dtype=torch.int64, device=q.device)
    l1 = torch.empty(R, G, dtype=torch.int64, device=q.device)
    _probe_kernel[(R,)](q.contiguous(), basis.contiguous(), planes, l1, G=G, D=D, BITS=bits, W=W, M=magnitude_bits,
                        num_warps=4)
    return planes, l1


def probe_planes_ref(q: torch.Tensor, basis: torch.Tensor, magnitude_bits: int):
    """The torch reference of `probe_planes`."""
    B, Hq, D = q.shape
    _, Hkv, bits, _ = basis.shape
    probe = q.view(B, Hkv, Hq // Hkv, D).float() @ basis.transpose(-1, -2)  # [B, Hkv, G, b]
    p = quantize_probe(probe, magnitude_bits)
    j = torch.arange(magnitude_bits, device=q.device)[:, None]
    planes = torch.cat([pack_bits(p >= 0)[..., None, :], pack_bits(((p.abs()[..., None, :] >> j) & 1).bool())], -2)
    return planes.flatten(0, 1), p.abs().sum(-1).flatten(0, 1)


# ---------------------------------------------------------------------------------------------- scoring

@triton.jit
def _popcount(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # SWAR: the interpreter has no libdevice; the masks make arithmetic shifts count right
        x = x - ((x >> 1) & 0x5555555555555555)
        x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
        return (x * 0x0101010101010101) >> 56
    else:
        return libdevice.popc(x).to(tl.int64)


@triton.jit
def _score_kernel(codes_ptr, planes_ptr, l1_ptr, positions_ptr, keys_ptr, S, OFFSET, HKV: tl.constexpr,
                  G: tl.constexpr, M: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr,
                  INTERPRET: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = s <= tl.load(positions_ptr + r // HKV)
    w = tl.arange(0, WP)
    tile = tl.load(codes_ptr + (r.to(tl.int64) * S + s[:, None]) * W + w[None, :],
                   mask=live[:, None] & (w[None, :] < W), other=0)  # [BLOCK, WP]
    best = tl.full([BLOCK], -(1 << 40), tl.int64)
    for g in tl.static_range(G):
        base = planes_ptr + (r * G + g) * (1 + M) * W
        clash = tl.zeros([BLOCK], dtype=tl.int64)
        for k in tl.static_range(W):
            x = tl.sum(tl.where(w[None, :] == k, tile, 0), 1) ^ tl.load(base + k)  # [BLOCK]: code XOR signs
            for j in tl.static_range(M):
                clash += _popcount(x & tl.load(base + (1 + j) * W + k), INTERPRET) << j
        best = tl.maximum(best, tl.load(l1_ptr + r * G + g) - 2 * clash)
    tl.store(keys_ptr + r.to(tl.int64) * S + s, (best + OFFSET).to(keys_ptr.dtype.element_ty), mask=live)


def score_keys(codes: torch.Tensor, planes: torch.Tensor, l1: torch.Tensor, positions: torch.Tensor,
               magnitude_bits: int, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """codes [B, Hkv, S, W] int64, planes / l1 from `probe_planes`, positions [B] -> keys [B*Hkv, S] (int16 or
    int32 by `key_range`; slots past a row's position are not written)."""
    B, Hkv, S, W = codes.shape
    R, G = l1.shape
    offset, key_bits = key_range(bits, magnitude_bits)
    if out is None:
        out = torch.empty(R, S, dtype=torch.int16 if key_bits == 16 else torch.int32, device=codes.device)
    block = min(1024, triton.next_power_of_2(S))
    _score_kernel[(R, triton.cdiv(S, block))](
        codes, planes, l1, positions, out, S, offset, HKV=Hkv, G=G, M=magnitude_bits, W=W,
        WP=triton.next_power_of_2(W), BLOCK=block, INTERPRET=interpreting(), num_warps=8)
    return out


def score_keys_ref(codes: torch.Tensor, planes: torch.Tensor, l1: torch.Tensor, positions: torch.Tensor,
                   magnitude_bits: int, bits: int) -> torch.Tensor:
    """The torch reference of `score_keys` (every slot scored, slots past the position left at 0)."""
    B, Hkv, S, W = codes.shape
    R, G = l1.shape
    offset, key_bits = key_range(bits, magnitude_bits)
    x = codes.view(R, 1, S, W) ^ planes[:, :, None, 0]  # [R, G, S, W]
    j = torch.arange(magnitude_bits, device=codes.device)
    clash = (popcount(x[:, :, None] & planes[:, :, 1:, None]).sum(-1) << j[:, None]).sum(2)  # [R, G, S]
    keys = (l1[..., None] - 2 * clash).amax(1) + offset  # [R, S]
    live = torch.arange(S, device=codes.device) <= positions.long().repeat_interleave(Hkv)[:, None]
    return torch.where(live, keys, 0).to(torch.int16 if key_bits == 16 else torch.int32)


# ---------------------------------------------------------------------------------------------- encoding

@triton.jit
def _encode_kernel(k_ptr, basis_ptr, codes_ptr, error_ptr, start_ptr, end_ptr, S, MAX_SLOTS, HKV: tl.constexpr,
                   D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    b = r // HKV
    nth = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(start_ptr + b) + nth
    live = (s < tl.load(end_ptr + b)) & (nth < MAX_SLOTS)
    d = tl.arange(0, D)
    w = tl.arange(0, WP)
    row = r.to(tl.int64) * S + s  # [BLOCK]
    residual = tl.load(k_ptr + row[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    words = tl.zeros([BLOCK, WP], dtype=tl.int64)
    for i in range(BITS):
        p = tl.load(basis_ptr + (r * BITS + i) * D + d)  # [D]
        plus = tl.sum(residual * p[None, :], 1) >= 0  # [BLOCK]
        residual -= tl.where(plus, 1.0, -1.0)[:, None] * p[None, :]
        bit = tl.where(plus, 1, 0).to(tl.int64) << (i % 64)
        words |= tl.where(w[None, :] == i // 64, bit[:, None], 0)
    tl.store(codes_ptr + row[:, None] * W + w[None, :], words, mask=live[:, None] & (w[None, :] < W))
    tl.store(error_ptr + row, tl.sqrt(tl.sum(residual * residual, 1)), mask=live)


def encode_slots(k: torch.Tensor, basis: torch.Tensor, codes: torch.Tensor, error: torch.Tensor,
                 start: torch.Tensor, end: torch.Tensor, max_slots: int) -> None:
    """Encode the slots [start[b], end[b]) of each row (at most `max_slots`) of keys k [B, Hkv, S, D] against
    basis [B, Hkv, b, D] fp32 into codes [B, Hkv, S, W] int64 and error [B, Hkv, S] fp32, in place."""
    B, Hkv, S, D = k.shape
    bits, W = basis.shape[2], codes.shape[-1]
    block = min(64, triton.next_power_of_2(max(max_slots, 1)))
    _encode_kernel[(B * Hkv, triton.cdiv(max(max_slots, 1), block))](
        k, basis, codes, error, start, end, S, max_slots, HKV=Hkv, D=D, BITS=bits, W=W, WP=triton.next_power_of_2(W),
        BLOCK=block, num_warps=4)


def encode_slots_ref(k: torch.Tensor, basis: torch.Tensor, codes: torch.Tensor, error: torch.Tensor,
                     start: torch.Tensor, end: torch.Tensor, max_slots: int) -> None:
    """The torch reference of `encode_slots`: the policy's residual `encode` of the slots in range, in place."""
    B, Hkv, S, D = k.shape
    slots = start.long()[:, None] + torch.arange(max(max_slots, 0), device=k.device)  # [B, n]
    live = (slots < end.long()[:, None]) & (slots < S)
    slots = torch.where(live, slots, 0)
    signs, err = encode(k.gather(2, slots[:, None, :, None].expand(-1, Hkv, -1, D)), basis)  # [B, Hkv, n, b]
    rows, cols = live.nonzero(as_tuple=True)  # the reference may wait for the device
    codes[rows, :, slots[rows, cols]] = pack_bits(signs)[rows, :, cols]
    error[rows, :, slots[rows, cols]] = err[rows, :, cols]
