"""Dense attention over the static cache: the reference every sparse policy is measured against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_mask(positions: torch.Tensor, kv_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """positions [B, T] -> bool [B, 1, T, kv_len]: slot j is visible to a query at position p iff j <= p
    (and j > p - window under a sliding window)."""
    slots = torch.arange(kv_len, device=positions.device)
    pos = positions[:, None, :, None]
    mask = slots <= pos
    if sliding_window is not None:
        mask = mask & (slots > pos - sliding_window)
    return mask


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, S, D], mask bool [B, 1, T, S] -> [B, Hq, T, D]. GQA: Hq % Hkv == 0."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def split_kv_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                              chunk: int = 256) -> torch.Tensor:
    """Flash-decoding in plain tensor ops: one query per row, keys split into chunks that are attended in parallel
    (a batched matrix product each), then merged by log-sum-exp. Parallel over B x Hkv x chunks, so a single
    sequence still fills the GPU.

    q [B, Hq, 1, D], k/v [B, Hkv, S, D] with S % chunk == 0, mask bool [B, 1, 1, S] -> [B, Hq, 1, D].
    """
    B, Hq, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    n = S // chunk
    qg = q.view(B, Hkv, 1, Hq // Hkv, D) * D**-0.5  # [B, Hkv, 1, G, D]
    scores = qg @ k.view(B, Hkv, n, chunk, D).transpose(-1, -2)  # [B, Hkv, n, G, C]
    visible = mask.view(B, 1, n, 1, chunk)
    scores = scores.float().masked_fill(~visible, float("-inf"))
    chunk_max = scores.amax(-1, keepdim=True)  # [B, Hkv, n, G, 1]
    any_visible = visible.any(-1, keepdim=True)
    chunk_max = torch.where(any_visible, chunk_max, torch.zeros_like(chunk_max))
    p = torch.exp(scores - chunk_max)
    partial = (p.to(v.dtype) @ v.view(B, Hkv, n, chunk, D)).float()  # [B, Hkv, n, G, D]
    total_max = chunk_max.masked_fill(~any_visible, float("-inf")).amax(2, keepdim=True)
    weight = torch.exp(chunk_max - total_max) * any_visible  # [B, Hkv, n, G, 1]
    out = (partial * weight).sum(2) / (p.sum(-1, keepdim=True) * weight).sum(2)  # [B, Hkv, G, D]
    return out.to(q.dtype).view(B, Hq, 1, D)
