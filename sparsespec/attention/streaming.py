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

    def fixed_selection(self, layer, q, cache):
        """Positions alone decide, so the selection is computed, not searched: the first `sinks` slots and the
        most recent ones filling the row's count (the set the radix select picks from the recency scores; the
        same for every KV head). A few element-wise kernels over [B, width], no pass over the cache."""
        plan, opts = self.fixed, self.options
        B, Hkv = q.shape[0], cache.k[layer].shape[1]
        n = plan.positions.long() + 1  # [B] slots up to the query
        sinks = n.clamp_max(opts.sinks)
        recent_from = (n - max(opts.window, 1)).clamp_min(0)
        forced = sinks + n - recent_from - (sinks - recent_from).clamp_min(0)
        count = torch.minimum(torch.maximum(plan.tokens.long(), forced), n).clamp_max(plan.width)  # [B]
        j = torch.arange(plan.width, device=q.device)
        idx = torch.where(j < sinks[:, None], j, j + (n - count)[:, None])  # [B, width]: in slot order
        into = plan.buffers(layer)
        into[0].view(B, Hkv, -1)[..., :plan.width].copy_(idx[:, None])
        into[1].view(B, Hkv).copy_(count[:, None])
        plan.attended.add_(count)
        return into
