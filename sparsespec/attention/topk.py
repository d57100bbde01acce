"""Oracle top-k: exact q·k over every key, the top-k per KV head (the upper bound of fixed-budget selection)."""

from __future__ import annotations

from .policy import SelectionPolicy, group_max


class OracleTopK(SelectionPolicy):
    name = "topk"

    def scores(self, layer, q, cache, positions):
        kv_len = max(self.host_positions(positions)) + 1
        keys, _ = cache.keys(layer, kv_len)  # [B, Hkv, S, D]
        B, Hq, _, D = q.shape
        Hkv = keys.shape[1]
        per_head = q.view(B, Hkv, Hq // Hkv, D).float() @ keys.float().transpose(-1, -2)  # [B, Hkv, G, S]
        return group_max(per_head.reshape(B, Hq, kv_len).float(), Hkv)
