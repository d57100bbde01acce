"""Double-P's cluster scoring in Triton: every query head of a KV head against its clusters' statistics, one pass.

    q        [B * Hkv * G, D]   the query heads, grouped by KV head (any float dtype)
    centroids, spread  [B, Hkv, C, D] fp32 or bf16: each cluster's mean key and per-dimension key variance
    -> logits [B, Hkv, G, C] fp32   x_i = q·c_i / √D
       ranked [B, Hkv, G, C] fp32   x_i + ½ Σ_d q_d² var_{i,d} / D (the spread estimate's log-mass term; with no
                                    spread, ranked is logits)

A program reads a block of clusters' centroids (and variances) once for all G heads of the group: the step reads
the statistics once, where the torch reference runs a batched product per statistic (a 4-row product, for which
cuBLAS picked a kernel that took 262 us for 34 MB at 128k, batch 1 on the H200). The reference,
`cluster_scores_ref`, is the CPU path.

The cluster index's upkeep in a fixed-width step, `join_leaving` (reference `join_leaving_ref`): the key that left
the recent window joins its nearest non-empty centroid, and that cluster's sums, size, centroid and variance
follow. Two launches: each program measures one block of a (row, KV head)'s centroids against the key and keeps
its nearest (squared distance and index packed in one int64, so the minimum is the nearest with ties to the lowest
index); one program a (row, KV head) then takes the minimum of its blocks and updates that one cluster. The torch
path computed a [B * Hkv, C] distance matrix from centred copies of every centroid (five passes over the index:
~2.3 ms of a 5.3 ms layer at 128k x 16 on the H200); this reads the centroids once. Double-P's CUDA step does not
read them even once more: `cluster_scores_nearest` measures each block's nearest centroid from the tile it scores,
and the join then scores its one changed cluster again (the same scores as joining first, then scoring).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .rotary import _rounded


@triton.jit
def _cluster_scores_kernel(q_ptr, c_ptr, var_ptr, logit_ptr, ranked_ptr, C, scale, half_over_d,
                           k_ptr, size_ptr, pos_ptr, end_ptr, cand_ptr, part_ptr, flag_ptr, S, window, sinks,
                           G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPREAD: tl.constexpr,
                           NEAREST: tl.constexpr, HKV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # b * Hkv + h
    offs_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs_c < C
    d = tl.arange(0, D)
    rows = (r * C + offs_c)[:, None] * D + d[None, :]
    cen = tl.load(c_ptr + rows, mask=live[:, None], other=0.0).to(tl.float32)  # [BLOCK, D]
    if NEAREST:  # the leaving key's nearest centroid of this block, from the tile just read
        _nearest_partial(cen, offs_c, live, r, k_ptr, size_ptr, pos_ptr, end_ptr, cand_ptr, part_ptr, flag_ptr, C,
                         S, tl.num_programs(1), window, sinks, HKV, D)
    if SPREAD:
        var = tl.load(var_ptr + rows, mask=live[:, None], other=0.0).to(tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)  # [D]
        x = tl.sum(cen * qg[None, :], 1) * scale  # [BLOCK]
        out = (r * G + g) * C + offs_c
        tl.store(logit_ptr + out, x, mask=live)
        if SPREAD:
            tl.store(ranked_ptr + out, x + tl.sum(var * (qg * qg)[None, :], 1) * half_over_d, mask=live)


def cluster_scores(qg: torch.Tensor, centroids: torch.Tensor, spread: torch.Tensor | None, block: int = 32,
                   num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """qg [B, Hkv, G, D], centroids / spread [B, Hkv, C, D] fp32 or bf16 (spread None: the centroid estimate) ->
    (logits, ranked) [B, Hkv, G, C] fp32 (see the module). Tuning: `block` clusters and `num_warps` a program."""
    return _scores(qg, centroids, spread, None, block, num_warps)[:2]


@dataclass(frozen=True)
class Leaving:
    """The key leaving each row's recent window at this step (`join_leaving`'s first arguments): k [B, Hkv, S, D]
    the cache, positions / clustered_end [B] int64, candidates [B] bool, size [B, Hkv, C] int64."""
    k: torch.Tensor
    positions: torch.Tensor
    clustered_end: torch.Tensor
    candidates: torch.Tensor
    size: torch.Tensor
    window: int
    sinks: int


def cluster_scores_nearest(qg: torch.Tensor, centroids: torch.Tensor, spread: torch.Tensor | None, leaving: Leaving,
                           block: int = 32, num_warps: int = 4
                           ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """`cluster_scores`, and from the same read of the centroids each block's nearest one to the leaving key ->
    (logits, ranked, nearest): `join_leaving(..., nearest=nearest, scores=(qg, logits, ranked))` then joins the key
    and re-scores its cluster, which gives the scores of joining first and scoring after."""
    return _scores(qg, centroids, spread, leaving, block, num_warps)


def _scores(qg, centroids, spread, leaving, block, num_warps):
    B, Hkv, G, D = qg.shape
    C = centroids.shape[2]
    assert centroids.is_contiguous() and (spread is None or spread.is_contiguous())
    logits = torch.empty(B, Hkv, G, C, dtype=torch.float32, device=qg.device)
    ranked = torch.empty_like(logits) if spread is not None else logits
    block = min(block, triton.next_power_of_2(C))
    nblk = triton.cdiv(C, block)
    nearest = None
    if leaving is not None:
        nearest = (torch.empty(B * Hkv, nblk, dtype=torch.int64, device=qg.device),
                   torch.empty(B * Hkv, dtype=torch.int8, device=qg.device))
        lv = (leaving.k, leaving.size, leaving.positions, leaving.clustered_end, leaving.candidates.to(torch.int8),
              *nearest, leaving.k.shape[2], leaving.window, leaving.sinks)
    else:
        lv = (centroids, centroids, centroids, centroids, centroids, centroids, centroids, 0, 0, 0)
    _cluster_scores_kernel[(B * Hkv, nblk)](
        qg.contiguous(), centroids, centroids if spread is None else spread, logits, ranked, C, D**-0.5, 0.5 / D,
        *lv, G=G, D=D, BLOCK=block, SPREAD=spread is not None, NEAREST=leaving is not None, HKV=Hkv,
        num_warps=num_warps)
    return logits, ranked, nearest


def cluster_scores_ref(qg: torch.Tensor, centroids: torch.Tensor, spread: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `cluster_scores` (batched products), the CPU path."""
    qg = qg.float()
    D = qg.shape[-1]
    logits = (qg @ centroids.float().transpose(-1, -2)) * D**-0.5  # [B, Hkv, G, C]
    if spread is None:
        return logits, logits
    return logits, logits + 0.5 * (qg.square() @ spread.float().transpose(-1, -2)) / D


# ---------------------------------------------------------------------------------------------- index upkeep

@triton.jit
def _leaving(pos_ptr, end_ptr, cand_ptr, b, window, sinks):
    """Row b's leaving slot this step and whether it joins a cluster: the clustered slots end at
    max(pos - window, sinks); exactly one slot left the window when that is one past the current end."""
    pos = tl.load(pos_ptr + b)
    target = tl.maximum(pos - window, sinks)
    move = (target == tl.load(end_ptr + b) + 1) & (tl.load(cand_ptr + b) != 0)
    return target, tl.maximum(target - 1, 0), move


@triton.jit
def _nearest_partial(cen, offs, live, r, k_ptr, size_ptr, pos_ptr, end_ptr, cand_ptr, part_ptr, flag_ptr, C, S,
                     NBLK, window, sinks, HKV: tl.constexpr, D: tl.constexpr):
    """The nearest non-empty centroid of the tile cen [BLOCK, D] (fp32; clusters offs, `live` in range) to row
    r's leaving key, as one int64 (distance bits, index) to part[r, block]; block 0 also records whether the key
    joins (flag[r])."""
    _, slot, move = _leaving(pos_ptr, end_ptr, cand_ptr, r // HKV, window, sinks)
    d = tl.arange(0, D)
    key = tl.load(k_ptr + (r * S + slot) * D + d).to(tl.float32)  # [D]
    diff = cen - key[None, :]
    dist = tl.sum(diff * diff, 1)  # [BLOCK] >= 0: its fp32 bits order as integers
    ok = live & (tl.load(size_ptr + r * C + offs, mask=live, other=0) > 0)
    bits = tl.where(ok, dist.to(tl.int32, bitcast=True), 0x7F800000)  # not a candidate: +inf
    blk = tl.program_id(1)
    tl.store(part_ptr + r * NBLK + blk, tl.min((bits.to(tl.int64) << 32) | offs.to(tl.int64), 0))
    if blk == 0:
        tl.store(flag_ptr + r, move.to(tl.int8))


@triton.jit
def _nearest_block_kernel(k_ptr, c_ptr, size_ptr, pos_ptr, end_ptr, cand_ptr, part_ptr, flag_ptr, C, S, NBLK,
                          window, sinks, HKV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # b * Hkv + h
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs < C
    d = tl.arange(0, D)
    cen = tl.load(c_ptr + (r * C + offs)[:, None] * D + d[None, :], mask=live[:, None],
                  other=0.0).to(tl.float32)  # [BLOCK, D]
    _nearest_partial(cen, offs, live, r, k_ptr, size_ptr, pos_ptr, end_ptr, cand_ptr, part_ptr, flag_ptr, C, S, NBLK,
                     window, sinks, HKV, D)


@triton.jit
def _join_kernel(k_ptr, v_ptr, pos_ptr, end_ptr, cand_ptr, part_ptr, flag_ptr, cen_ptr, ksum_ptr, ksq_ptr,
                 vsum_ptr, vmean_ptr, size_ptr, var_ptr, assign_ptr, q_ptr, logit_ptr, ranked_ptr, C, S, NBLK,
                 window, sinks, scale, half_over_d, HKV: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                 SPREAD: tl.constexpr, INDEX: tl.constexpr, RESCORE: tl.constexpr, G: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = r // HKV
    target, slot, _ = _leaving(pos_ptr, end_ptr, cand_ptr, b, window, sinks)
    move = tl.load(flag_ptr + r) != 0  # decided before any program of the row moved its end
    best = tl.full([CHUNK], 0x7FFFFFFFFFFFFFFF, tl.int64)
    for s in range(0, NBLK, CHUNK):
        i = s + tl.arange(0, CHUNK)
        best = tl.minimum(best, tl.load(part_ptr + r * NBLK + i, mask=i < NBLK, other=0x7FFFFFFFFFFFFFFF))
    idx = tl.min(best, 0) & 0xFFFFFFFF
    if move:
        d = tl.arange(0, D)
        row = (r * C + idx) * D + d
        key = tl.load(k_ptr + (r * S + slot) * D + d).to(tl.float32)
        ks = tl.load(ksum_ptr + row) + key
        sq = tl.load(ksq_ptr + row) + key * key
        tl.store(ksum_ptr + row, ks)
        tl.store(ksq_ptr + row, sq)
        vs = tl.load(vsum_ptr + row) + tl.load(v_ptr + (r * S + slot) * D + d).to(tl.float32)
        tl.store(vsum_ptr + row, vs)
        n = tl.load(size_ptr + r * C + idx) + 1
        # every thread reads the (scalar) size before one of them stores it: without the barrier a late warp
        # could read the new size and divide by one more
        tl.debug_barrier()
        tl.store(size_ptr + r * C + idx, n)
        nf = n.to(tl.float32)
        mean = tl.math.div_rn(ks, nf)
        cen = _rounded(mean, INDEX)
        tl.store(cen_ptr + row, cen)
        tl.store(vmean_ptr + row, _rounded(tl.math.div_rn(vs, nf), INDEX))
        if SPREAD:  # cluster_variance, rounded as torch rounds it
            var = _rounded(tl.maximum(tl.math.div_rn(sq, nf) - mean * mean, 0.0), INDEX)
            tl.store(var_ptr + row, var)
        if RESCORE:  # the joined cluster's scores, as `cluster_scores` computes them from the new statistics
            for g in tl.static_range(G):
                qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)
                x = tl.sum(cen * qg, 0) * scale
                tl.store(logit_ptr + (r * G + g) * C + idx, x)
                if SPREAD:
                    tl.store(ranked_ptr + (r * G + g) * C + idx, x + tl.sum(var * (qg * qg), 0) * half_over_d)
        tl.store(assign_ptr + r * S + slot, idx)
        if r % HKV == 0:
            tl.store(end_ptr + b, target)


def join_leaving(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, clustered_end: torch.Tensor,
                 candidates: torch.Tensor, centroids: torch.Tensor, key_sum: torch.Tensor, key_sq_sum: torch.Tensor,
                 value_sum: torch.Tensor, value_mean: torch.Tensor, size: torch.Tensor, spread: torch.Tensor | None,
                 assign: torch.Tensor, window: int, sinks: int,
                 nearest: tuple[torch.Tensor, torch.Tensor] | None = None,
                 scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, block: int = 64) -> None:
    """Before a step at `positions`, in place: in each row whose window moved on by one slot, the key that left it
    joins its nearest non-empty centroid (squared distance, ties to the lowest index; none non-empty: cluster 0).

    k, v              [B, Hkv, S, D] the cache (any float dtype)
    positions         [B] int64  each row's query position; the clustered slots end at max(pos - window, sinks)
    clustered_end     [B] int64  advanced by one where a slot joins
    candidates        [B] bool   rows with clusters (the others keep their decoded tokens exact)
    key_sum, key_sq_sum, value_sum  [B, Hkv, C, D] fp32
    centroids, value_mean, spread (or None)  [B, Hkv, C, D] fp32 or bf16 (one dtype): the means and variances
    size              [B, Hkv, C] int64
    assign            [B, Hkv, S] int64  the joining slot's cluster
    nearest           each block's nearest centroid from `cluster_scores_nearest` (None: measured here)
    scores            (qg, logits, ranked) from it: the joined cluster's entries are computed again
    A row moves only when its clustered slots end exactly one before the new end (`DoubleP._cluster_leaving`)."""
    B, Hkv, S, D = k.shape
    C = size.shape[-1]
    assert centroids.dtype in (torch.float32, torch.bfloat16) and value_mean.dtype == centroids.dtype
    assert spread is None or spread.dtype == centroids.dtype
    for t in (centroids, key_sum, key_sq_sum, value_sum, value_mean, spread, size, assign, k, v):
        assert t is None or t.is_contiguous()
    cand = candidates.to(torch.int8)
    if nearest is None:
        nblk = triton.cdiv(C, block)
        nearest = (torch.empty(B * Hkv, nblk, dtype=torch.int64, device=k.device),
                   torch.empty(B * Hkv, dtype=torch.int8, device=k.device))
        _nearest_block_kernel[(B * Hkv, nblk)](k, centroids, size, positions, clustered_end, cand, *nearest, C, S,
                                               nblk, window, sinks, HKV=Hkv, D=D, BLOCK=block, num_warps=4)
    part, flag = nearest
    nblk = part.shape[-1]
    qg, logits, ranked = (centroids, centroids, centroids) if scores is None else scores
    G = 1 if scores is None else qg.shape[2]
    _join_kernel[(B * Hkv,)](k, v, positions, clustered_end, cand, part, flag, centroids, key_sum, key_sq_sum,
                             value_sum, value_mean, size, centroids if spread is None else spread, assign,
                             qg.contiguous(), logits, ranked, C, S, nblk, window, sinks, D**-0.5, 0.5 / D, HKV=Hkv,
                             D=D, CHUNK=min(1024, triton.next_power_of_2(nblk)), SPREAD=spread is not None,
                             INDEX=tl.bfloat16 if centroids.dtype == torch.bfloat16 else tl.float32,
                             RESCORE=scores is not None, G=G, num_warps=4, enable_fp_fusion=False)


def join_leaving_ref(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, clustered_end: torch.Tensor,
                     candidates: torch.Tensor, centroids: torch.Tensor, key_sum: torch.Tensor,
                     key_sq_sum: torch.Tensor, value_sum: torch.Tensor, value_mean: torch.Tensor, size: torch.Tensor,
                     spread: torch.Tensor | None, assign: torch.Tensor, window: int, sinks: int) -> None:
    """The torch reference of `join_leaving` (same arguments), the CPU path: the nearest centroid by Double-P's
    tie-tolerant `nearest` (centroids within rounding of the nearest count as tied), the updates as masked
    scatters over every row."""
    from ..attention.doublep import cluster_variance, nearest

    B, Hkv, _, D = k.shape
    C = size.shape[-1]
    target = (positions - window).clamp_min(sinks)  # [B]: clustered slots end here at this step
    move = (target == clustered_end + 1) & candidates  # [B]: one slot a row, where the window moved on by one
    slot = (target - 1).clamp_min(0).view(B, 1, 1, 1)
    keys = k.gather(2, slot.expand(B, Hkv, 1, D)).float()  # [B, Hkv, 1, D]
    values = v.gather(2, slot.expand(B, Hkv, 1, D)).float()
    idx = nearest(keys.view(B * Hkv, 1, D), centroids.view(B * Hkv, C, D),
                  (size > 0).view(B * Hkv, C)).view(B, Hkv, 1)
    w = move.view(B, 1, 1, 1).float()
    at = idx[..., None].expand(B, Hkv, 1, D)
    key_sum.scatter_add_(2, at, keys * w)
    key_sq_sum.scatter_add_(2, at, keys.square() * w)
    value_sum.scatter_add_(2, at, values * w)
    size.scatter_add_(2, idx, move.long().view(B, 1, 1).expand(B, Hkv, 1))
    n = size.gather(2, idx)[..., None]  # [B, Hkv, 1, 1]
    mean = key_sum.gather(2, at) / n.clamp_min(1)
    centroids.scatter_(2, at, torch.where(n > 0, mean, centroids.gather(2, at).float()).to(centroids.dtype))
    value_mean.scatter_(2, at, (value_sum.gather(2, at) / n.clamp_min(1)).to(value_mean.dtype))
    if spread is not None:  # the changed cluster's variance, as `cluster_variance` computes every one
        spread.scatter_(2, at, cluster_variance(key_sum.gather(2, at), key_sq_sum.gather(2, at), size.gather(2, idx))
                        .to(spread.dtype))
    at_slot = slot.view(B, 1, 1).expand(B, Hkv, 1)
    assign.scatter_(2, at_slot, torch.where(move.view(B, 1, 1), idx, assign.gather(2, at_slot)))
    clustered_end.copy_(torch.where(move, target, clustered_end))
