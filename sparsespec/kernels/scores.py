"""Scorer kernels of the policies that rank keys by float scores (oracle top-k, Quest): they write the int32 keys
`select_topk` reads directly, in IEEE order (`select.ordered_keys`), without float score tensors in between. Each
has its torch reference (`*_ref`), which is also the CPU path.

    topk   q [B, Hq, D], k [B, Hkv, S, D] (any float dtype), positions [B]
           -> keys [B*Hkv, S] int32: the group max of q·k; slots past a row's position are not written
    quest  q [B, Hq, D], kmin / kmax [B, Hkv, NP, D] (page extrema, NP * page >= S), positions [B], page
           -> keys [B*Hkv, S] int32: the page's bound Σ_g Σ_d max(q_d min_d, q_d max_d) for slots before the
           position, 0 (never attend) from it on; slots past it are not written
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attend import _TL_DTYPES
from .select import ordered_keys


@triton.jit
def _ordered(x):
    """fp32 -> int32 key in IEEE order: -inf -> 0, +inf -> all bits set, -0.0 equal to 0.0."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits | (-2147483647 - 1), ~bits)
    key = tl.where(x == float("-inf"), 0, key)
    return tl.where(x == float("inf"), -1, key)


@triton.jit
def _topk_kernel(q_ptr, k_ptr, positions_ptr, keys_ptr, S, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                 D: tl.constexpr, BLOCK: tl.constexpr, DOT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """keys of slots [BLOCK) of row r: the group max of q·k. DOT: the group's products as one matrix product
    ([BLOCK, D] x [D, GP] in DOT_DTYPE, the G query heads padded to GP rows, fp32 accumulation), else per head
    in fp32."""
    r = tl.program_id(0)
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = s <= tl.load(positions_ptr + r // HKV)
    d = tl.arange(0, D)
    k = tl.load(k_ptr + (r.to(tl.int64) * S + s)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
    if DOT:
        g = tl.arange(0, GP)
        q = tl.load(q_ptr + (r * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)  # [GP, D]
        scores = tl.dot(k.to(DOT_DTYPE), tl.trans(q.to(DOT_DTYPE)), input_precision="ieee")  # [BLOCK, GP] fp32
        best = tl.max(tl.where((g < G)[None, :], scores, float("-inf")), 1)
    else:
        k = k.to(tl.float32)  # [BLOCK, D]
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        for h in tl.static_range(G):
            qg = tl.load(q_ptr + (r * G + h) * D + d).to(tl.float32)
            best = tl.maximum(best, tl.sum(k * qg[None, :], 1))
    tl.store(keys_ptr + r.to(tl.int64) * S + s, _ordered(best), mask=live)


def topk_keys(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None,
              block: int = 128, num_warps: int = 8, dot: bool = True):
    """q [B, Hq, D], k [B, Hkv, S, D], positions [B] -> keys [B*Hkv, S] int32 (see the module). Tuning: `block`
    slots and `num_warps` a program; `dot`: the group's products on the tensor cores (q cast to k's dtype; fp32
    under the CPU interpreter, which has no bf16 matrix product)."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.empty(B * Hkv, S, dtype=torch.int32, device=q.device) if out is None else out
    block = min(block, triton.next_power_of_2(S))
    G = Hq // Hkv
    _topk_kernel[(B * Hkv, triton.cdiv(S, block))](q.contiguous(), k, positions, out, S, HKV=Hkv, G=G,
                                                  GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK=block, DOT=dot,
                                                  DOT_DTYPE=tl.float32 if q.device.type == "cpu" else _TL_DTYPES[k.dtype],
                                                  num_warps=num_warps)
    return out


def topk_keys_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The torch reference of `topk_keys` (every slot scored)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    scores = (q.view(B, Hkv, Hq // Hkv, D).float() @ k.float().transpose(-1, -2)).amax(2)  # [B, Hkv, S]
    return ordered_keys(scores).flatten(0, 1)


@triton.jit
def _quest_kernel(q_ptr, kmin_ptr, kmax_ptr, positions_ptr, keys_ptr, S, NP, HKV: tl.constexpr, G: tl.constexpr,
                  D: tl.constexpr, PAGE: tl.constexpr, PAGEP: tl.constexpr, BP: tl.constexpr):
    r = tl.program_id(0)
    p = tl.program_id(1) * BP + tl.arange(0, BP)  # pages
    pos = tl.load(positions_ptr + r // HKV)
    d = tl.arange(0, D)
    page = (r.to(tl.int64) * NP + p)[:, None] * D + d[None, :]
    used = (p * PAGE <= pos) & (p < NP)
    lo = tl.load(kmin_ptr + page, mask=used[:, None], other=0.0).to(tl.float32)  # [BP, D]
    hi = tl.load(kmax_ptr + page, mask=used[:, None], other=0.0).to(tl.float32)
    bound = tl.zeros([BP], dtype=tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)[None, :]
        bound += tl.sum(tl.maximum(qg * lo, qg * hi), 1)
    t = tl.arange(0, PAGEP)
    slot = p[:, None] * PAGE + t[None, :]  # [BP, PAGEP]
    key = tl.where(slot < pos, _ordered(bound)[:, None], 0)
    tl.store(keys_ptr + r.to(tl.int64) * S + slot, key, mask=(t[None, :] < PAGE) & (slot <= pos) & (slot < S))


def quest_keys(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, positions: torch.Tensor, page: int, S: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D], kmin / kmax [B, Hkv, NP, D], positions [B], page size, S slots -> keys [B*Hkv, S] int32."""
    B, Hq, D = q.shape
    Hkv, NP = kmin.shape[1], kmin.shape[2]
    out = torch.empty(B * Hkv, S, dtype=torch.int32, device=q.device) if out is None else out
    bp = min(32, triton.next_power_of_2(NP))
    _quest_kernel[(B * Hkv, triton.cdiv(NP, bp))](q.contiguous(), kmin, kmax, positions, out, S, NP, HKV=Hkv,
                                                 G=Hq // Hkv, D=D, PAGE=page, PAGEP=triton.next_power_of_2(page),
                                                 BP=bp, num_warps=4)
    return out


def quest_keys_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, positions: torch.Tensor, page: int,
                   S: int) -> torch.Tensor:
    """The torch reference of `quest_keys` (every slot written)."""
    from ..attention.quest import page_bounds

    B, Hq, D = q.shape
    Hkv = kmin.shape[1]
    bounds = page_bounds(q.view(B, Hkv, Hq // Hkv, D).float(), kmin.float(), kmax.float())  # [B, Hkv, G, NP]
    scores = bounds.sum(2).repeat_interleave(page, dim=-1)[..., :S]  # [B, Hkv, S]
    scores = scores.masked_fill(torch.arange(S, device=q.device) >= positions.long().view(B, 1, 1), float("-inf"))
    return ordered_keys(scores).flatten(0, 1)
