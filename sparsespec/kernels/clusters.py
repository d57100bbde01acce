"""Double-P's cluster scoring in Triton: every query head of a KV head against its clusters' statistics, one pass.

    q        [B * Hkv * G, D]   the query heads, grouped by KV head (any float dtype)
    centroids, spread  [B, Hkv, C, D] fp32: each cluster's mean key and per-dimension key variance
    -> logits [B, Hkv, G, C] fp32   x_i = q·c_i / √D
       ranked [B, Hkv, G, C] fp32   x_i + ½ Σ_d q_d² var_{i,d} / D (the spread estimate's log-mass term; with no
                                    spread, ranked is logits)

A program reads a block of clusters' centroids (and variances) once for all G heads of the group: the step reads
the statistics once, where the torch reference runs a batched product per statistic (a 4-row product, for which
cuBLAS picked a kernel that took 262 us for 34 MB at 128k, batch 1 on the H200). The reference,
`cluster_scores_ref`, is the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cluster_scores_kernel(q_ptr, c_ptr, var_ptr, logit_ptr, ranked_ptr, C, scale, half_over_d,
                           G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPREAD: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # b * Hkv + h
    offs_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = offs_c < C
    d = tl.arange(0, D)
    rows = (r * C + offs_c)[:, None] * D + d[None, :]
    cen = tl.load(c_ptr + rows, mask=live[:, None], other=0.0)  # [BLOCK, D] fp32
    if SPREAD:
        var = tl.load(var_ptr + rows, mask=live[:, None], other=0.0)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)  # [D]
        x = tl.sum(cen * qg[None, :], 1) * scale  # [BLOCK]
        out = (r * G + g) * C + offs_c
        tl.store(logit_ptr + out, x, mask=live)
        if SPREAD:
            tl.store(ranked_ptr + out, x + tl.sum(var * (qg * qg)[None, :], 1) * half_over_d, mask=live)


def cluster_scores(qg: torch.Tensor, centroids: torch.Tensor, spread: torch.Tensor | None, block: int = 32,
                   num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """qg [B, Hkv, G, D], centroids / spread [B, Hkv, C, D] fp32 (spread None: the centroid estimate) ->
    (logits, ranked) [B, Hkv, G, C] fp32 (see the module). Tuning: `block` clusters and `num_warps` a program."""
    B, Hkv, G, D = qg.shape
    C = centroids.shape[2]
    assert centroids.dtype == torch.float32 and centroids.is_contiguous()
    assert spread is None or (spread.dtype == torch.float32 and spread.is_contiguous())
    logits = torch.empty(B, Hkv, G, C, dtype=torch.float32, device=qg.device)
    ranked = torch.empty_like(logits) if spread is not None else logits
    block = min(block, triton.next_power_of_2(C))
    _cluster_scores_kernel[(B * Hkv, triton.cdiv(C, block))](
        qg.contiguous(), centroids, centroids if spread is None else spread, logits, ranked, C, D**-0.5, 0.5 / D,
        G=G, D=D, BLOCK=block, SPREAD=spread is not None, num_warps=num_warps)
    return logits, ranked


def cluster_scores_ref(qg: torch.Tensor, centroids: torch.Tensor, spread: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `cluster_scores` (batched products), the CPU path."""
    qg = qg.float()
    D = qg.shape[-1]
    logits = (qg @ centroids.transpose(-1, -2)) * D**-0.5  # [B, Hkv, G, C]
    if spread is None:
        return logits, logits
    return logits, logits + 0.5 * (qg.square() @ spread.transpose(-1, -2)) / D
