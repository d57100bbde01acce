"""The assignment step of k-means (Double-P's clustering of the keys) in Triton: each point's nearest centroid.

A GEMM with an argmax epilogue: a program takes BLOCK_P points of one batch entry and streams every centroid tile
past them, keeping the best score 2 p·c − ‖c‖² (= ‖p‖² − ‖p − c‖², larger = nearer) of each (point, tile column)
and the tile it came from, and takes each point's best of its columns at the end, so the [N, K] distance matrix is
never written (at 128k keys and 16k clusters a head it would be 8 GiB in fp32). On the H200 at that size one pass
over a row's 8 heads takes 325 ms in fp32 on the CUDA cores, 19 ms in tf32 and 13 ms in bf16 on the tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def _nearest_kernel(p_ptr, c_ptr, bias_ptr, out_ptr, N, K,
                    stride_pg, stride_pn, stride_cg, stride_ck, stride_bg, stride_og,
                    D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, DOT: tl.constexpr,
                    PRECISION: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D)
    live = offs_p < N
    pts = tl.load(p_ptr + g * stride_pg + offs_p[:, None] * stride_pn + offs_d[None, :], mask=live[:, None],
                  other=0.0).to(DOT)  # [BLOCK_P, D]
    # each (point, column) slot's best score over the tiles so far and the tile it came from: elementwise, the rows'
    # reductions once at the end (a later tile must beat a slot's best: ties keep the lowest index)
    best = tl.full([BLOCK_P, BLOCK_C], float("-inf"), tl.float32)
    tile = tl.zeros([BLOCK_P, BLOCK_C], tl.int32)
    for start in range(0, K, BLOCK_C):
        offs_c = start + tl.arange(0, BLOCK_C)
        in_k = offs_c < K
        cen = tl.load(c_ptr + g * stride_cg + offs_c[:, None] * stride_ck + offs_d[None, :], mask=in_k[:, None],
                      other=0.0).to(DOT)  # [BLOCK_C, D]
        bias = tl.load(bias_ptr + g * stride_bg + offs_c, mask=in_k, other=float("-inf"))  # −‖c‖², −inf: invalid
        s = 2.0 * tl.dot(pts, tl.trans(cen), input_precision=PRECISION) + bias[None, :]  # [BLOCK_P, BLOCK_C]
        better = s > best
        best = tl.where(better, s, best)
        tile = tl.where(better, start, tile)
    top = tl.max(best, 1)  # [BLOCK_P]; the lowest index of the slots that reach it (all -inf: 0)
    arg = tl.min(tl.where(best == top[:, None], tile + tl.arange(0, BLOCK_C)[None, :], K), 1)
    tl.store(out_ptr + g * stride_og + offs_p, arg.to(tl.int64), mask=live)


PRECISIONS = ("ieee", "tf32", "bf16")  # the dot products: fp32 on CUDA cores; tensor cores on 10- or 8-bit mantissas
# (points a program, centroids a step, warps) by precision: the fastest measured on the H200 at 128k keys, 16k
# clusters, head_dim 128 (bench/kmeans_build.py; docs/results/doublep.md)
TILINGS = {"ieee": (64, 64, 4), "tf32": (128, 64, 8), "bf16": (64, 64, 4)}


def nearest_centroid(points: torch.Tensor, centroids: torch.Tensor, valid: torch.Tensor | None = None,
                     precision: str = "ieee", centre: bool = True,
                     tiling: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Each point's nearest centroid by squared Euclidean distance, batched.

    points     [G, N, D]  fp32 (any float; D a power of two, 16 to 256)
    centroids  [G, K, D]  fp32
    valid      [G, K]     bool or None: a centroid that is not valid is never chosen (unless none is: index 0)
    -> [G, N] int64. Ties (equal computed scores) go to the lowest index. `precision` (CUDA; the interpreter computes
    in fp32): the dot products in fp32 ("ieee"), or on the tensor cores from inputs rounded to tf32 or bf16 (fp32
    accumulation); either way points a rounding error apart from two centroids may go to either. `centre`: points
    and centroids are centred on the points' mean first (distances are shift-invariant; it keeps the scores'
    magnitude, and their rounding, small); off for inputs centred already. `tiling`: (points a program, centroids
    a step, warps), powers of two >= 16 (None: the precision's in `TILINGS`)."""
    G, N, D = points.shape
    K = centroids.shape[1]
    assert centroids.shape == (G, K, D) and D == triton.next_power_of_2(D) and 16 <= D <= 256
    assert precision in PRECISIONS, precision
    if points.device.type == "cpu":  # (the interpreter computes in fp32)
        precision = "ieee"
    dot = torch.bfloat16 if precision == "bf16" else torch.float32  # (rounded here: the kernel reads fewer bytes)
    offset = points.float().mean(1, keepdim=True) if centre else None
    p = (points if offset is None else points.float() - offset).to(dot).contiguous()
    c = centroids.float() if offset is None else centroids.float() - offset
    bias = -c.square().sum(-1)  # [G, K]
    c = c.to(dot).contiguous()
    if valid is not None:
        bias = bias.masked_fill(~valid, float("-inf"))
    out = torch.empty(G, N, dtype=torch.long, device=points.device)
    if N == 0:
        return out
    block_p, block_c, num_warps = tiling or TILINGS[precision]
    _nearest_kernel[(G, triton.cdiv(N, block_p))](
        p, c, bias.contiguous(), out, N, K, p.stride(0), p.stride(1), c.stride(0), c.stride(1), K, N,
        D=D, BLOCK_P=block_p, BLOCK_C=block_c, DOT=tl.bfloat16 if precision == "bf16" else tl.float32,
        PRECISION="tf32" if precision == "tf32" else "ieee", num_warps=num_warps)
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
