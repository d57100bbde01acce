"""Static, position-indexed KV cache shared by prefill and decode.

Slot `p` of row `b` holds the key/value of the token at position `p` of that row, so the attention mask is plain
causality on positions, padded rows need no bookkeeping (a pad written past a row's end is never visible to that
row's real queries and is overwritten by its next real token), and rolling back a speculative step is just setting
`lengths` back: whatever lies past a row's length is dead.

Each layer also has a `policy_state` slot where a sparse-attention policy keeps its own index beside K/V.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .config import ModelConfig
from .errors import SparseSpecError


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device | str):
        if capacity > cfg.max_position:
            raise SparseSpecError(f"requested {capacity} positions but the model's context is "
                                  f"{cfg.max_position} tokens")
        # One tensor per layer, written in place, never through a view: torch.compile then updates it in place
        # instead of copying the whole cache at every step.
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]  # [B, Hkv, S, D]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.capacity = capacity
        self.lengths = [0] * batch  # committed tokens per row; the rollback point
        self.policy_state: list[Any] = [None] * cfg.num_layers

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, Hkv, T, D] at slots `positions` [B, T]."""
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        # Advanced indices on dims 0 and 2 move to the front: the target view is [B, T, Hkv, D].
        self.k[layer][rows, :, positions] = k.transpose(1, 2)
        self.v[layer][rows, :, positions] = v.transpose(1, 2)

    def move(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy, in every layer, slots src [M, N] of rows [M] to slots dst [M, N] (all sources read before any
        destination is written: the two may overlap)."""
        rows = rows[:, None]
        for k, v in zip(self.k, self.v):
            k[rows, :, dst] = k[rows, :, src]  # [M, N, Hkv, D]
            v[rows, :, dst] = v[rows, :, src]

    def keys(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, Hkv, kv_len, D] views of slots [0, kv_len)."""
        return self.k[layer][:, :, :kv_len], self.v[layer][:, :, :kv_len]

    def rows(self, start: int, stop: int) -> "KVCache":
        """The cache of rows [start, stop) alone: views of their slots (written in place), their lengths, and no
        policy index yet."""
        view = copy.copy(self)
        view.k = [k[start:stop] for k in self.k]
        view.v = [v[start:stop] for v in self.v]
        view.lengths = self.lengths[start:stop]
        view.policy_state = [None] * len(view.k)
        return view

    def truncate(self, lengths: list[int]) -> None:
        """Roll rows back (or forward after a commit) to `lengths` tokens."""
        if len(lengths) != self.batch or any(n < 0 or n > self.capacity for n in lengths):
            raise ValueError(f"invalid cache lengths {lengths} for batch {self.batch}, capacity {self.capacity}")
        self.lengths = list(lengths)
