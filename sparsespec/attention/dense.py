"""Dense attention over the static cache: the reference every sparse policy is measured against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .policy import Policy


def causal_mask(positions: torch.Tensor, kv_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """positions [B, T] -> bool [B, 1, T, kv_len]: slot j is visible to a query at position p iff j <= p
    (and j > p - window under a sliding window)."""
    slots = torch.arange(kv_len, device=positions.device)
    pos = positions[:, None, :, None]
    mask = slots <= pos
    if sliding_window is not None:
        mask = mask & (slots > pos - sliding_window)
    return mask


def tree_mask(base: torch.Tensor, tree: torch.Tensor, kv_len: int) -> torch.Tensor:
    """base [B] (the block's first slot), tree [B, T] int64 ancestor bits -> bool [B, T, kv_len]: query t sees the
    slots before base and the block slots base + j whose bit j is set."""
    rel = torch.arange(kv_len, device=tree.device) - base.long()[:, None]  # [B, S]
    bit = (tree[:, :, None] >> rel.clamp(0, 63)[:, None, :]) & 1  # [B, T, S]
    T = tree.shape[1]
    return (rel < 0)[:, None, :] | ((rel < T)[:, None, :] & (bit == 1))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, S, D], mask bool [B, 1, T, S] -> [B, Hq, T, D]. GQA: Hq % Hkv == 0."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


class Dense(Policy):
    """Full attention in every layer: the baseline, and what every policy reproduces at a full budget."""

    name = "dense"

    def is_sparse(self, layer: int) -> bool:
        return False

    def decode(self, layer, q, cache, positions):
        kv_len = max(self.host_positions(positions)) + 1
        keys, values = cache.keys(layer, kv_len)
        return dense_attention(q, keys, values, causal_mask(positions[:, None], kv_len))
