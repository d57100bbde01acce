"""StreamingLLM: position-only selection, attention sinks plus the most recent tokens filling the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .policy import PolicyOptions, SelectionPolicy


@dataclass(frozen=True)
class StreamingOptions(PolicyOptions):
    sinks: int = 4


class StreamingLLM(SelectionPolicy):
    name = "streaming"
    Options = StreamingOptions

    def scores(self, layer, q, cache, positions):
        kv_len = max(self.host_positions(positions)) + 1
        recency = torch.arange(kv_len, device=q.device, dtype=torch.float32)
        return recency.expand(q.shape[0], cache.k[layer].shape[1], kv_len)
