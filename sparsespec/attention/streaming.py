"""StreamingLLM: position-only selection, attention sinks plus the most recent tokens filling the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .policy import SelectionOptions, SelectionPolicy


@dataclass(frozen=True)
class StreamingOptions(SelectionOptions):
    sinks: int = 4


class StreamingLLM(SelectionPolicy):
    name = "streaming"
    Options = StreamingOptions

    def scores(self, layer, q, cache, positions):
        kv_len = max(self.host_positions(positions)) + 1
        recency = torch.arange(kv_len, device=q.device, dtype=torch.float32)
        return recency.expand(q.shape[0], cache.k[layer].shape[1], kv_len)

    def plan_fixed(self, cache, lengths):
        super().plan_fixed(cache, lengths)
        self._sparse_layers = sum(self.is_sparse(i) for i in range(len(cache.k)))

    def begin_step(self, positions):
        super().begin_step(positions)
        plan = self.fixed
        if plan.kept is None:  # every sparse layer attends to the same slots: selected once a step
            count = self._positional(plan.idx, plan.count)
            plan.attended.add_(count * self._sparse_layers)

    def fixed_selection(self, layer, q, cache, into=None):
        """Positions alone decide, so the selection is computed, not searched (`_positional`), once a step for
        every layer (`begin_step`); with kept selections (select_every > 1) into `into` (default the layer's own
        buffers)."""
        plan = self.fixed
        if plan.kept is None:
            return plan.idx, plan.count
        into = plan.buffers(layer) if into is None else into
        plan.attended.add_(self._positional(*into))
        return into

    def _positional(self, idx_out: torch.Tensor, count_out: torch.Tensor) -> torch.Tensor:
        """The first `sinks` slots and the most recent ones filling the row's count (the set the radix select
        picks from the recency scores; the same for every KV head) into idx_out [B * Hkv, W >= width] and
        count_out [B * Hkv]: a few element-wise kernels over [B, width], no pass over the cache. -> count [B]."""
        plan, opts = self.fixed, self.options
        B = plan.positions.shape[0]
        n = plan.positions.long() + 1  # [B] slots up to the query
        sinks = n.clamp_max(opts.sinks)
        recent_from = (n - max(opts.window, 1)).clamp_min(0)
        forced = sinks + n - recent_from - (sinks - recent_from).clamp_min(0)
        count = torch.minimum(torch.maximum(plan.tokens.long(), forced), n).clamp_max(plan.width)  # [B]
        j = torch.arange(plan.width, device=n.device)
        idx = torch.where(j < sinks[:, None], j, j + (n - count)[:, None])  # [B, width]: in slot order
        idx_out.view(B, -1, idx_out.shape[1])[..., :plan.width].copy_(idx[:, None])
        count_out.view(B, -1).copy_(count[:, None])
        return count
