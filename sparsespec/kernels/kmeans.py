"""The assignment step of k-means (Double-P's clustering of the keys) in Triton: each point's nearest centroid.

A GEMM with an argmax epilogue: a program takes BLOCK_P points of one batch entry and streams every centroid tile
past them, keeping each point's best score 2 p·c − ‖c‖² (= ‖p‖² − ‖p − c‖², larger = nearer) and its index, so
the [N, K] distance matrix is never written (at 128k keys and 8k clusters a head it would be 4 GiB in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_P = 64  # points per program
BLOCK_C = 64  # centroids per inner step


@triton.jit
def _nearest_kernel(p_ptr, c_ptr, bias_ptr, out_ptr, N, K,
                    stride_pg, stride_pn, stride_cg, stride_ck, stride_bg, stride_og,
                    D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, DOT: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D)
    live = offs_p < N
    pts = tl.load(p_ptr + g * stride_pg + offs_p[:, None] * stride_pn + offs_d[None, :], mask=live[:, None],
                  other=0.0).to(DOT)  # [BLOCK_P, D]
    best = tl.full([BLOCK_P], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_P], tl.int32)
    for start in range(0, K, BLOCK_C):
        offs_c = start + tl.arange(0, BLOCK_C)
        in_k = offs_c < K
        cen = tl.load(c_ptr + g * stride_cg + offs_c[:, None] * stride_ck + offs_d[None, :], mask=in_k[:, None],
                      other=0.0).to(DOT)  # [BLOCK_C, D]
        bias = tl.load(bias_ptr + g * stride_bg + offs_c, mask=in_k, other=float("-inf"))  # −‖c‖², −inf: invalid
        s = 2.0 * tl.dot(pts, tl.trans(cen), input_precision="ieee") + bias[None, :]  # [BLOCK_P, BLOCK_C]
        tile_best = tl.max(s, 1)
        tile_arg = tl.argmax(s, 1, tie_break_left=True).to(tl.int32) + start
        better = tile_best > best  # a later tile must beat the best so far: ties keep the lowest index
        arg = tl.where(better, tile_arg, arg)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + g * stride_og + offs_p, arg.to(tl.int64), mask=live)


def nearest_centroid(points: torch.Tensor, centroids: torch.Tensor, valid: torch.Tensor | None = None,
                     fast: bool = False, centre: bool = True) -> torch.Tensor:
    """Each point's nearest centroid by squared Euclidean distance, batched.

    points     [G, N, D]  fp32 (any float; D a power of two, 16 to 256)
    centroids  [G, K, D]  fp32
    valid      [G, K]     bool or None: a centroid that is not valid is never chosen (unless none is: index 0)
    -> [G, N] int64. Ties (equal computed scores) go to the lowest index. `fast`: the dot products from bf16
    inputs (fp32 accumulation, tensor cores) instead of exact fp32; either way points a rounding error apart from
    two centroids may go to either. `centre`: points and centroids are centred on the points' mean first (distances
    are shift-invariant; it keeps the scores' magnitude, and their rounding, small); off for inputs centred
    already."""
    G, N, D = points.shape
    K = centroids.shape[1]
    assert centroids.shape == (G, K, D) and D == triton.next_power_of_2(D) and 16 <= D <= 256
    offset = points.float().mean(1, keepdim=True) if centre else 0.0
    p = (points.float() - offset).contiguous()
    c = (centroids.float() - offset).contiguous()
    bias = -c.square().sum(-1)  # [G, K]
    if valid is not None:
        bias = bias.masked_fill(~valid, float("-inf"))
    out = torch.empty(G, N, dtype=torch.long, device=points.device)
    if N == 0:
        return out
    cpu = points.device.type == "cpu"
    _nearest_kernel[(G, triton.cdiv(N, BLOCK_P))](
        p, c, bias.contiguous(), out, N, K, p.stride(0), p.stride(1), c.stride(0), c.stride(1), K, N,
        D=D, BLOCK_P=BLOCK_P, BLOCK_C=BLOCK_C, DOT=tl.bfloat16 if fast and not cpu else tl.float32, num_warps=4)
    return out


def nearest_centroid_ref(points: torch.Tensor, centroids: torch.Tensor,
                         valid: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of `nearest_centroid` (fp64 scores, the whole [G, N, K] matrix; small sizes)."""
    offset = points.double().mean(1, keepdim=True)
    p, c = points.double() - offset, centroids.double() - offset
    score = 2 * p @ c.transpose(1, 2) - c.square().sum(-1)[:, None]  # [G, N, K]
    if valid is not None:
        score = score.masked_fill(~valid[:, None], float("-inf"))
    return score.argmax(-1)
