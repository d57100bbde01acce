"""Oracle top-k: exact q·k over every key, the top-k per KV head (the upper bound of fixed-budget selection)."""

from __future__ import annotations

from .policy import BudgetOptions, SelectKeys, SelectionPolicy, group_max


class OracleTopK(SelectionPolicy):
    name = "topk"
    Options = BudgetOptions

    def scores(self, layer, q, cache, positions):
        kv_len = max(self.host_positions(positions)) + 1
        keys, _ = cache.keys(layer, kv_len)  # [B, Hkv, S, D]
        B, Hq, _, D = q.shape
        Hkv = keys.shape[1]
        per_head = q.view(B, Hkv, Hq // Hkv, D).float() @ keys.float().transpose(-1, -2)  # [B, Hkv, G, S]
        return group_max(per_head.reshape(B, Hq, kv_len).float(), Hkv)

    def fixed_keys(self, layer, q, cache):
        from ..kernels import triton_ready
        from ..kernels.scores import topk_keys, topk_keys_ref

        B, Hq, _, D = q.shape
        keys = (topk_keys if triton_ready(q.device) else topk_keys_ref)(q.view(B, Hq, D), cache.k[layer],
                                                                        self.fixed.positions)
        return SelectKeys(keys, 32)
