"""MagicPIG-style selection: SimHash LSH on centred keys, candidates ranked by their collision count.

Per (row, layer, KV head) the mean μ of the prefill keys is kept, and every key is hashed as k − μ (centring
makes the keys spread around the origin, where random hyperplanes separate them well; q·(k − μ) = q·k − q·μ
ranks the keys of one query exactly as q·k does). Per layer, L tables of K random hyperplanes W [L, K, D]
(seeded by (seed, layer)) give each key L codes of K bits: bit i of table t is [W[t, i] · (k − μ) >= 0].
Decoded tokens are hashed as they are committed. A decode query (not centred) is hashed the same way per query
head; a key's score is the number of tables whose code equals the query's, maxed over the KV head's query heads.
Keys colliding in fewer than `min_collisions` tables are not candidates.

This is a budget-capped collision-count selector: the top (budget) candidates by collision count get exact
attention, on top of the sink tokens and the local window. MagicPIG proper samples the candidates and corrects
the attention with importance weights (an adaptive, unbiased estimate); what we compare at equal budget is the
LSH retrieval, not the estimator.

    simhash (build at prefill, append after every commit; rollback forgets codes past the committed length)
    simhash(q) -> collision_counts -> max over the group (decode)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SparseSpecError
from .policy import SelectionOptions, SelectionPolicy, device_ints, option


@dataclass(frozen=True)
class MagicPIGOptions(SelectionOptions):
    sinks: int = 4
    window: int = 64
    hash_bits: int = option(8, "K: SimHash bits per table")
    tables: int = option(64, "L: hash tables")
    min_collisions: int = option(2, "tables a key must share with the query to be a candidate")
    seed: int = option(0, "seed of the random hyperplanes")

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.hash_bits <= 31:
            raise SparseSpecError(f"hash_bits must be in [1, 31], got {self.hash_bits}")
        if self.tables < 1:
            raise SparseSpecError(f"tables must be >= 1, got {self.tables}")
        if not 0 <= self.min_collisions <= self.tables:
            raise SparseSpecError(f"min_collisions must be in [0, tables={self.tables}], got {self.min_collisions}")


def hyperplanes(tables: int, bits: int, dim: int, seed: int, layer: int) -> torch.Tensor:
    """-> W [tables, bits, dim] fp32, standard normal, the same for a given (seed, layer) on every device."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    return torch.randn(tables, bits, dim, generator=gen)


def simhash(x: torch.Tensor, planes: torch.Tensor) -> torch.Tensor:
    """x [..., D], planes [L, K, D] -> codes [..., L] int64: bit i of code t is [planes[t, i] · x >= 0]."""
    L, K, _ = planes.shape
    bits = torch.einsum("...d,lkd->...lk", x.float(), planes) >= 0  # [..., L, K]
    return (bits.long() << torch.arange(K, device=x.device)).sum(-1)


def collision_counts(codes: torch.Tensor, q_codes: torch.Tensor) -> torch.Tensor:
    """Key codes [B, Hkv, S, L], query codes [B, Hkv, G, L] -> [B, Hkv, G, S] int64: tables where they agree.
    One query head at a time, so the [.., S, L] comparison is never materialised G times."""
    return torch.stack([(codes == q_codes[:, :, g, None, :]).sum(-1) for g in range(q_codes.shape[2])], 2)


@dataclass
class MagicPIGState:
    planes: torch.Tensor  # [L, K, D] fp32
    mean: torch.Tensor  # [B, Hkv, D] fp32: mean prefill key
    codes: torch.Tensor  # [B, Hkv, capacity, L] int16 (K <= 15) or int32
    hashed: list[int]  # slots [0, hashed[b]) of row b hold valid codes


class MagicPIG(SelectionPolicy):
    name = "magicpig"
    graphable = False  # its index keeps per-row Python counters (eager steps only)
    Options = MagicPIGOptions

    def build(self, layer, cache, lengths):
        if not self.is_sparse(layer):
            return
        opts = self.options
        k = cache.k[layer]  # [B, Hkv, S, D]
        B, Hkv, S, D = k.shape
        dtype = torch.int16 if opts.hash_bits <= 15 else torch.int32
        state = MagicPIGState(
            planes=hyperplanes(opts.tables, opts.hash_bits, D, opts.seed, layer).to(k.device),
            mean=torch.zeros(B, Hkv, D, device=k.device),
            codes=torch.zeros(B, Hkv, S, opts.tables, dtype=dtype, device=k.device),
            hashed=[0] * B,
        )
        for b, n in enumerate(lengths):
            if n > 0:
                state.mean[b] = k[b, :, :n].float().mean(1)
            self._hash(state, k, b, 0, n)
        cache.policy_state[layer] = state

    @staticmethod
    def _hash(state: MagicPIGState, k: torch.Tensor, row: int, start: int, end: int) -> None:
        if end > start:
            centred = k[row, :, start:end].float() - state.mean[row, :, None]  # [Hkv, n, D]
            state.codes[row, :, start:end] = simhash(centred, state.planes).to(state.codes.dtype)
        state.hashed[row] = end

    def append(self, layer, cache, lengths):
        state: MagicPIGState | None = cache.policy_state[layer]
        if state is None:
            return
        for b, n in enumerate(lengths):
            # A rollback forgets the codes past the committed length; growth hashes the new tokens.
            self._hash(state, cache.k[layer], b, min(state.hashed[b], n), n)

    def scores(self, layer, q, cache, positions):
        state: MagicPIGState = cache.policy_state[layer]
        B, Hq, _, D = q.shape
        Hkv = state.mean.shape[1]
        kv_len = max(self.host_positions(positions)) + 1
        q_codes = simhash(q.view(B, Hkv, Hq // Hkv, D), state.planes).to(state.codes.dtype)  # [B, Hkv, G, L]
        counts = collision_counts(state.codes[:, :, :kv_len], q_codes).amax(2).float()  # [B, Hkv, S]
        slots = torch.arange(kv_len, device=q.device)
        hashed = device_ints(state.hashed, q.device).view(B, 1, 1)
        out_of_index = (counts < self.options.min_collisions) | (slots >= hashed)
        return counts.masked_fill(out_of_index, float("-inf"))
