"""Cross-entropy over a large vocabulary without an fp32 copy of the logits: the DFlash training loss.

A training step of the 1.5B's drafter scores 7,680 block positions against 151,936 tokens: 2.3 GB of bf16 logits.
torch's loss under autocast first copies them to fp32 (4.7 GB), runs log-softmax and its backward over that copy and
zero-fills an fp32 gradient: ~17 of the step's 44 ms of kernels on the H200 went to those passes (2 ms here). Here one program per row
streams the row in chunks (online max and sum, fp32 arithmetic) and the backward writes the gradient in the logits'
dtype in one more pass:

    _ce_forward_kernel   grid (N,): lse[n] = logsumexp(x[n]), loss[n] = lse[n] − x[n, label[n]] (0 where label < 0)
    _ce_backward_kernel  grid (N,): dx[n] = (softmax(x[n]) − onehot(label[n])) · g[n] (0 where label < 0)

    cross_entropy(logits [N, V], labels [N] int64) -> loss [N] fp32, differentiable in logits: logits bf16, fp16 or
    fp32 (the gradient in that dtype), labels −100 (any negative) where nothing is predicted. `cross_entropy_ref`
    is the torch reference (and the CPU path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary entries a program reads at a time


@triton.jit
def _ce_forward_kernel(x, labels, lse, loss, V, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -3.0e38, tl.float32)  # per-lane running max (finite: no lane computes −inf − (−inf))

    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        xs = tl.load(x + row * stride_x + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, xs)
        s = s * tl.exp(m - m_new) + tl.exp(xs - m_new)
        m = m_new
    top = tl.max(m, 0)
    row_lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    label = tl.load(labels + row)
    hit = tl.load(x + row * stride_x + tl.maximum(label, 0)).to(tl.float32)
    tl.store(lse + row, row_lse)
    tl.store(loss + row, tl.where(label >= 0, row_lse - hit, 0.0))


@triton.jit
def _ce_backward_kernel(x, labels, lse, g, dx, V, stride_x, stride_dx, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    label = tl.load(labels + row)
    scale = tl.where(label >= 0, tl.load(g + row), 0.0)
    row_lse = tl.load(lse + row)
    for start in range(0, V, BLOCK):
        cols = start + offs
        ok = cols < V
        xs = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        grad = (tl.exp(xs - row_lse) - tl.where(cols == label, 1.0, 0.0)) * scale
        tl.store(dx + row * stride_dx + cols, grad.to(dx.dtype.element_ty), mask=ok)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        N, V = logits.shape
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        loss = torch.empty(N, dtype=torch.float32, device=logits.device)
        if N:
            _ce_forward_kernel[(N,)](logits, labels, lse, loss, V, logits.stride(0), BLOCK=BLOCK_V, num_warps=8)
        ctx.save_for_backward(logits, labels, lse)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        N, V = logits.shape
        dx = torch.empty_like(logits)
        if N:
            _ce_backward_kernel[(N,)](logits, labels, lse, grad.float().contiguous(), dx, V, logits.stride(0),
                                      dx.stride(0), BLOCK=BLOCK_V, num_warps=8)
        return dx, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (bf16 / fp16 / fp32), labels [N] int64 (negative: none) -> loss [N] fp32 (0 where none)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1] or labels.dtype != torch.int64 or \
            logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"cross_entropy needs logits [N, V] (bf16/fp16/fp32) and int64 labels [N]; got "
                         f"{list(logits.shape)} {logits.dtype} and {list(labels.shape)} {labels.dtype}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _CrossEntropy.apply(logits, labels.contiguous())


def cross_entropy_ref(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The torch reference of `cross_entropy` (fp32 arithmetic; 0 where the label is negative)."""
    ce = F.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")
    return torch.where(labels >= 0, ce, 0.0)
