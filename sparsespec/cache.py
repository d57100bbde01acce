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
from .kernels.compact import address_table, compact_path, compact_path_ref


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
        self._addresses: torch.Tensor | None = None  # the layers' addresses, for `compact`

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

    def compact(self, starts: torch.Tensor, bits: torch.Tensor, width: int) -> None:
        """A tree verify's accepted paths, in every layer: row b's slots starts[b] + j whose bit j is set in bits[b]
        (j < width; bit 0 always), ascending, to slots starts[b], starts[b] + 1, ... (`kernels.compact`; one launch
        on a GPU, torch on a CPU). starts, bits [B] int64 on the cache's device: no read-back."""
        if self.device.type == "cuda":
            compact_path(self.k, self.v, starts, bits, width, self.addresses())
        else:
            compact_path_ref(self.k, self.v, starts, bits, width)

    def addresses(self) -> torch.Tensor:
        """[2L] int64 on the device: the layers' K then V addresses (`compact`'s table; uploaded once)."""
        if self._addresses is None:
            self._addresses = address_table(self.k, self.v)
        return self._addresses

    def keys(self, layer: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, Hkv, kv_len, D] views of slots [0, kv_len)."""
        return self.k[layer][:, :, :kv_len], self.v[layer][:, :, :kv_len]

    def rows(self, start: int, stop: int) -> "KVCache":
        """The cache of rows [start, stop) alone: views of their slots (written in place), their lengths, and no
        policy index yet."""
        view = copy.copy(self)
        view.k = [k[start:stop] for k in self.k]
        view._addresses = None
        view.v = [v[start:stop] for v in self.v]
        view.lengths = self.lengths[start:stop]
        view.policy_state = [None] * len(view.k)
        return view

    def truncate(self, lengths: list[int]) -> None:
        """Roll rows back (or forward after a commit) to `lengths` tokens."""
        if len(lengths) != self.batch or any(n < 0 or n > self.capacity for n in lengths):
            raise ValueError(f"invalid cache lengths {lengths} for batch {self.batch}, capacity {self.capacity}")
        self.lengths = list(lengths)
