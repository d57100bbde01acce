"""Row-invariant RMSNorm for decode and verify steps: each row normalised bitwise the same whatever the other rows
are — how many rows the step has, where the row sits among them.

torch's reduction kernels and Inductor's compiled norms choose their block shapes (and so the order in which a row's
squares are summed) by the tensor's size, and Inductor may also choose among candidate configurations by timing them;
a token's norm in a verify block can then round differently from the same token's in a one-token decode step. Here
one program normalises one row with the whole row in one block and a fixed number of warps, so a row's reduction
order depends on its length (N) alone:

    _rms_norm_kernel  grid (M,): y[m] = weight · (x[m] · rsqrt(mean(x[m]²) + eps)), the normalised row rounded to
                      x's dtype before the weight's product (as `RMSNorm` does), fp32 arithmetic

    rms_norm(x [M, N], weight [N], eps) -> y [M, N]: x, weight bf16 or fp16 (one dtype), N <= MAX_N; `rms_norm_ref`
    is the torch reference. Launches depend on shapes alone: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_N = 16384  # a whole row in one block
NUM_WARPS = 4  # part of the reduction order's definition: fixed
_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(x, w, y, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    xf = tl.load(x + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv).to(y.dtype.element_ty).to(tl.float32)
    weight = tl.load(w + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y + row * stride_y + offs, (weight * normed).to(y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N], weight [N] (one dtype: bf16/fp16) -> y [M, N] in x's dtype; every row reduced in the same order
    whatever M is."""
    M, N = x.shape
    if weight.shape != (N,) or weight.dtype != x.dtype or x.dtype not in _DTYPES or N > MAX_N:
        raise ValueError(f"rms_norm needs x [M, N] and weight [N] of one dtype (bf16/fp16), N <= {MAX_N}; got "
                         f"{list(x.shape)} {x.dtype} and {list(weight.shape)} {weight.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _rms_norm_kernel[(M,)](x, weight.contiguous(), y, N, x.stride(0), y.stride(0), eps,
                               BLOCK=triton.next_power_of_2(N), num_warps=NUM_WARPS)
    return y


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch reference of `rms_norm` (what `models.transformer.RMSNorm` computes)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
