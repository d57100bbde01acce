"""Scorer kernels of the policies that rank keys by float scores (oracle top-k, Quest): they write the int32 keys
`select_topk` reads directly, in IEEE order (`select.ordered_keys`), without float score tensors in between. Each
has its torch reference (`*_ref`), which is also the CPU path.

    topk   q [B, Hq, D], k [B, Hkv, S, D] (any float dtype), positions [B]
           -> keys [B*Hkv, S] int32: the group max of q·k; slots past a row's position are not written
    quest  q [B, Hq, D], k [B, Hkv, S, D], kmin / kmax [B, Hkv, NP, D] (page extrema, NP * page >= S),
           positions [B], page -> keys [B*Hkv, NP] int32, one a page: the bound Σ_g Σ_d max(q_d min_d, q_d max_d)
           of the pages before the query's, 0 for the query's own page (the selection forces it in); pages past
           it are not written. It first brings the extrema of the page holding slot position - 1 (the token the
           last step committed) up to date from the cache, in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import chained, wait_inputs

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
                 D: tl.constexpr, BLOCK: tl.constexpr, DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr):
    """keys of slots [BLOCK) of row r: the group max of q·k. DOT: the group's products as one matrix product
    ([BLOCK, D] x [D, GP] in DOT_DTYPE, the G query heads padded to GP rows, fp32 accumulation), else per head
    in fp32."""
    wait_inputs(PDL)
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
    dot_dtype = tl.float32 if q.device.type == "cpu" else _TL_DTYPES[k.dtype]
    _topk_kernel[(B * Hkv, triton.cdiv(S, block))](q.contiguous(), k, positions, out, S, HKV=Hkv, G=G,
                                                  GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK=block, DOT=dot,
                                                  DOT_DTYPE=dot_dtype, num_warps=num_warps, **chained(q.device))
    return out


def topk_keys_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The torch reference of `topk_keys` (every slot scored)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    scores = (q.view(B, Hkv, Hq // Hkv, D).float() @ k.float().transpose(-1, -2)).amax(2)  # [B, Hkv, S]
    return ordered_keys(scores).flatten(0, 1)


@triton.jit
def _quest_kernel(q_ptr, k_ptr, kmin_ptr, kmax_ptr, positions_ptr, keys_ptr, S, NP, HKV: tl.constexpr,
                  G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PAGEP: tl.constexpr, BP: tl.constexpr,
                  PDL: tl.constexpr):
    """Keys of pages [BP) of row r; the program holding the page of the last committed token (slot pos - 1)
    recomputes its extrema from the cache first (stored, and used for its key)."""
    wait_inputs(PDL)
    r = tl.program_id(0)
    p0 = tl.program_id(1) * BP
    p = p0 + tl.arange(0, BP)  # pages
    pos = tl.load(positions_ptr + r // HKV)
    current = pos // PAGE
    rd = r.to(tl.int64)
    d = tl.arange(0, D)
    page = (rd * NP + p)[:, None] * D + d[None, :]
    scored = p < current
    lo = tl.load(kmin_ptr + page, mask=scored[:, None], other=0.0).to(tl.float32)  # [BP, D]
    hi = tl.load(kmax_ptr + page, mask=scored[:, None], other=0.0).to(tl.float32)
    last = tl.maximum(pos - 1, 0) // PAGE
    refresh = (last >= p0) & (last < p0 + BP)
    if refresh:
        t = tl.arange(0, PAGEP)
        slot = last * PAGE + t
        live = ((t < PAGE) & (slot < pos))[:, None]
        keys = tl.load(k_ptr + (rd * S + slot)[:, None] * D + d[None, :], mask=live, other=0.0)  # [PAGEP, D]
        new_lo = tl.min(tl.where(live, keys, float("inf")), 0)  # [D], exact in the key dtype
        new_hi = tl.max(tl.where(live, keys, float("-inf")), 0)
        tl.store(kmin_ptr + (rd * NP + last) * D + d, new_lo.to(kmin_ptr.dtype.element_ty))
        tl.store(kmax_ptr + (rd * NP + last) * D + d, new_hi.to(kmax_ptr.dtype.element_ty))
        fresh = ((p == last) & scored)[:, None]  # a scored page is whole: finite extrema
        lo = tl.where(fresh, new_lo.to(tl.float32)[None, :], lo)
        hi = tl.where(fresh, new_hi.to(tl.float32)[None, :], hi)
    bound = tl.zeros([BP], dtype=tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)[None, :]
        bound += tl.sum(tl.maximum(qg * lo, qg * hi), 1)
    tl.store(keys_ptr + rd * NP + p, tl.where(scored, _ordered(bound), 0), mask=p <= current)


def quest_keys(q: torch.Tensor, k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, positions: torch.Tensor,
               page: int, out: torch.Tensor | None = None, block: int = 32, num_warps: int = 4) -> torch.Tensor:
    """q [B, Hq, D], k [B, Hkv, S, D] (the cache), kmin / kmax [B, Hkv, NP, D] (page extrema, updated in place),
    positions [B], page size -> keys [B*Hkv, NP] int32 (see the module). Tuning: `block` pages and `num_warps`
    a program."""
    B, Hq, D = q.shape
    Hkv, S, NP = k.shape[1], k.shape[2], kmin.shape[2]
    out = torch.empty(B * Hkv, NP, dtype=torch.int32, device=q.device) if out is None else out
    bp = min(block, triton.next_power_of_2(NP))
    _quest_kernel[(B * Hkv, triton.cdiv(NP, bp))](q.contiguous(), k, kmin, kmax, positions, out, S, NP, HKV=Hkv,
                                                 G=Hq // Hkv, D=D, PAGE=page, PAGEP=triton.next_power_of_2(page),
                                                 BP=bp, num_warps=num_warps, **chained(q.device))
    return out


def quest_keys_ref(q: torch.Tensor, k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, positions: torch.Tensor,
                   page: int) -> torch.Tensor:
    """The torch reference of `quest_keys` (every page written: 0 from the current one on)."""
    from ..attention.quest import page_bounds, refresh_last_page

    B, Hq, D = q.shape
    Hkv, NP = kmin.shape[1], kmin.shape[2]
    refresh_last_page(kmin, kmax, k, positions.long(), page)
    bounds = page_bounds(q.view(B, Hkv, Hq // Hkv, D).float(), kmin.float(), kmax.float())  # [B, Hkv, G, NP]
    current = (positions.long() // page).view(B, 1, 1)
    scores = bounds.sum(2).masked_fill(torch.arange(NP, device=q.device) >= current, float("-inf"))  # [B, Hkv, NP]
    return ordered_keys(scores).flatten(0, 1)
