"""Row-invariant matrix products for decode and verify steps: y = x · Wᵀ (+ b) over a few rows (a batch's decode
tokens, a speculative verify block), each row's result bitwise the same whatever the other rows are — however many
rows the step has and wherever the row sits among them.

cuBLAS chooses its algorithm (tile shapes, split-K) by the number of rows, so a token's logits in a 6-token verify
step can round differently from the same token's in a 1-token decode step; at a near-tie the greedy output of
speculative decoding then departs from plain decoding. Here every output element is reduced in an order fixed by
(N, K) and the device alone:

    _partial_kernel  grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits): split s of the K dimension for a tile of
                     BLOCK_M = 16 rows (one MMA shape for any row count) and BLOCK_N output columns; the row tiles
                     of one weight tile are neighbouring programs, so it comes from memory once and from L2 for
                     the rest; fp32 accumulation
                     -> part [splits, M, N] fp32, or with one split y itself (bias added, cast)
    _reduce_kernel   grid (cdiv(M·N, BLOCK),): the splits summed in split order, bias added, cast -> y [M, N]

    row_matmul(x [M, K], weight [N, K], bias [N] | None) -> y [M, N]: x, weight, bias bf16 or fp16 (one dtype);
    contiguous rows. `row_matmul_ref` is the torch reference (fp32 products, one rounding). With FP8 weights
    (`fp8_weights`: float8_e4m3fn and a scale per output column) the same kernel reads half the bytes: for a
    speculative drafter's steps, whose output only proposes (the verify stays in the model's dtype).

Launch parameters depend on shapes alone (no read-back): a caller can capture them in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per MMA tile, whatever M is: part of the reduction order's definition
REDUCE_BLOCK = 1024
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class Tiles:
    """How `row_matmul` tiles a product: output columns and K per program tile, warps and pipeline stages a
    program, and `waves`: K splits planned for about `waves` programs per multiprocessor. Chosen by (N, K) alone,
    never by the row count (block_k and the splits fix each row's reduction order)."""

    block_n: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 3
    waves: int = 2

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.warps not in (1, 2, 4, 8, 16) or self.stages < 1 or self.waves < 1:
            raise ValueError(f"invalid tiles {self}")


TILES = Tiles()  # the plain tiling (the sweep's baseline)


def tiles_for(n: int, k: int) -> Tiles:
    """The tiling for an [·, k] x [k, n] product, by its shape alone: per product kind, the tiling best on average
    over 1 and 16 rows in bench/matmul_sweep.py (H200, qwen2.5-coder-1.5b shape; each size's best tilings took
    0.92x / 0.95x cuBLAS's time over a step's products, `TILES` 1.01x / 1.06x). Narrow outputs (q/k/v, o) take 16
    columns a program and long K tiles, so that many programs stream the few columns; products whose K is three
    times N or more (down) take short K tiles and deep pipelines; very wide ones (an LM head) large tiles; the rest
    (gate/up) 64 x 128."""
    if k >= 3 * n:
        return Tiles(block_n=64, block_k=64, stages=5, waves=2)
    if n <= 4096:
        return Tiles(block_n=16, block_k=256, stages=5, waves=2)
    if n >= 65536:
        return Tiles(block_n=128, block_k=128, stages=3, waves=4)
    return Tiles(block_n=64, block_k=128, stages=3, waves=2)


@triton.jit
def _partial_kernel(x, w, scale, bias, out, M, N, K, chunk, stride_xm, stride_wn, stride_os, stride_om,
                    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, FINAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the row tiles sharing a weight tile run side by side (it is read once)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_start = split * chunk
    k_end = tl.minimum(k_start + chunk, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < k_end
        a = tl.load(x + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w + offs_n[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]: Wᵀ's tile
        acc = tl.dot(a.to(DOT), b.to(DOT), acc, input_precision="ieee")
    if HAS_SCALE:  # FP8 weights: each output column's scale (a split's share of the sum scales alike)
        acc *= tl.load(scale + offs_n, mask=n_ok, other=0.0)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    dest = out + split * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if FINAL:
        if HAS_BIAS:
            acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(dest, acc.to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(dest, acc, mask=mask)


@triton.jit
def _reduce_kernel(part, bias, y, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part + offs, mask=ok, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y + offs, acc.to(y.dtype.element_ty), mask=ok)


def plan(n: int, k: int, programs: int, tiles: Tiles = TILES) -> tuple[int, int]:
    """(splits of K, K chunk per split) for an [·, k] x [k, n] product on a device with `programs`
    multiprocessors: enough splits for ~`tiles.waves` programs each, chunks of whole block_k tiles, at least 4
    tiles a split. Independent of the row count (that is the point)."""
    tiles_k = triton.cdiv(k, tiles.block_k)
    splits = max(1, min(triton.cdiv(tiles.waves * programs, triton.cdiv(n, tiles.block_n)), tiles_k // 4))
    chunk = triton.cdiv(tiles_k, splits) * tiles.block_k
    return triton.cdiv(k, chunk), chunk


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the CPU interpreter (tests)


def row_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               programs: int | None = None, tiles: Tiles | None = None, scale: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] or None -> y [M, N] = x · weightᵀ + bias, in x's dtype (bf16/fp16), fp32
    accumulation, every row reduced in the same order whatever M is. `programs`: the parallelism the K splits are
    planned for (default: the device's multiprocessor count); `tiles`: the tiling (default `tiles_for` the shape;
    the same for every call of a given weight, or rows of different calls may round differently). FP8 weights
    (`fp8_weights`: float8_e4m3fn with `scale` [N] fp32, y = x · (weight · scale)ᵀ + bias): half the bytes to read,
    converted in registers."""
    M, K = x.shape
    N = weight.shape[0]
    fp8 = weight.dtype == torch.float8_e4m3fn
    if weight.shape[1] != K or x.dtype not in _TL_DTYPES or (weight.dtype != x.dtype and not fp8):
        raise ValueError(f"row_matmul needs x [M, K] and weight [N, K] of one dtype (bf16/fp16) or FP8 weights, "
                         f"got {list(x.shape)} {x.dtype} and {list(weight.shape)} {weight.dtype}")
    if fp8 != (scale is not None) or (fp8 and (scale.shape != (N,) or scale.dtype != torch.float32)):
        raise ValueError("row_matmul takes a scale [N] fp32 with FP8 weights and none with others")
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    tiles = tiles or tiles_for(N, K)
    splits, chunk = plan(N, K, programs or _programs(x.device), tiles)
    has_bias = bias is not None
    b = bias if has_bias else x  # (not read)
    sc = scale if fp8 else x  # (not read)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, tiles.block_n), splits)
    # (the CPU interpreter's bf16/fp16 dot is unreliable: it multiplies the same values in fp32 there)
    dot = tl.float32 if x.device.type == "cpu" else _TL_DTYPES[x.dtype]
    meta = dict(BLOCK_M=BLOCK_M, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT=dot, num_warps=tiles.warps,
                num_stages=tiles.stages)
    if splits == 1:
        _partial_kernel[grid](x, weight, sc, b, y, M, N, K, chunk, x.stride(0), weight.stride(0), 0, y.stride(0),
                              HAS_SCALE=fp8, HAS_BIAS=has_bias, FINAL=True, **meta)
        return y
    part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    _partial_kernel[grid](x, weight, sc, b, part, M, N, K, chunk, x.stride(0), weight.stride(0), part.stride(0),
                          part.stride(1), HAS_SCALE=fp8, HAS_BIAS=False, FINAL=False, **meta)
    _reduce_kernel[(triton.cdiv(M * N, REDUCE_BLOCK),)](part, b, y, M * N, N, SPLITS=splits, HAS_BIAS=has_bias,
                                                        BLOCK=REDUCE_BLOCK)
    return y


def row_matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of `row_matmul`: fp32 products and sum, one rounding to x's dtype."""
    w = weight.float() if scale is None else weight.float() * scale[:, None]
    y = x.float() @ w.T
    return (y if bias is None else y + bias.float()).to(x.dtype)


FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def fp8_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8_e4m3fn [N, K], scale [N] fp32): each output row scaled so its largest magnitude
    maps to FP8_MAX (3 mantissa bits: an element within 2⁻⁴ of its value, relative, unless it is tiny)."""
    w = weight.float()
    scale = (w.abs().amax(1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [N]
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
