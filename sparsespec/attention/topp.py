"""Top-p baselines: the oracle (exact softmax, smallest set reaching p) and a Twilight-style selector.

Both select per query head and take the union over a KV head's query heads (so every query head gets its p),
plus the forced sinks / window / current token; attention over the union is exact.

Twilight-style: a base fixed-budget selector (Quest by default) proposes candidates; their keys are estimated at
low precision (per-token asymmetric `bits`-bit quantisation, emulated by quantise-dequantise of the gathered keys);
softmax over the candidates of the estimated scores; top-p within the candidates. Mass is therefore relative to
the candidates, not to the whole context: the weakness Double-P addresses.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import SparseSpecError
from .policy import Policy, PolicyOptions, SelectionPolicy, attend_selected, forced_slots, option, selection_mask


@dataclass(frozen=True)
class TopPOptions(PolicyOptions):
    p: float = option(0.95, "attend the smallest set of keys holding this share of the attention mass")

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.p <= 1:
            raise SparseSpecError(f"p must be in (0, 1], got {self.p}")


@dataclass(frozen=True)
class TwilightOptions(TopPOptions):
    base: str = option("quest", "the candidate selector (a selection policy name)")
    candidates: float = option(0.25, "the candidate selector's budget: a share of the context (<= 1) or a count")
    bits: int = option(4, "bits of the quantised keys that estimate the attention mass")
    min_tokens: int = option(256, "the candidate selector's floor: at least this many candidates")

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.bits <= 16:
            raise SparseSpecError(f"bits must be in [1, 16], got {self.bits}")
        if not 0 < self.candidates < float("inf"):
            raise SparseSpecError(f"candidates must be a positive finite number, got {self.candidates}")


def top_p_mask(probs: torch.Tensor, p: float) -> torch.Tensor:
    """probs [..., S] -> bool [..., S]: the smallest set of largest entries whose mass reaches p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < p  # keep while the mass before is short of p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def mask_to_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, Hkv, S] -> (indices [B, Hkv, K], valid [B, Hkv, K]) with K = the largest count."""
    count = mask.sum(-1)
    k = max(int(count.max()), 1)
    idx = torch.argsort(mask.to(torch.int8), dim=-1, descending=True, stable=True)[..., :k]
    return idx, torch.arange(k, device=mask.device) < count[..., None]


class OracleTopP(Policy):
    name = "topp"
    Options = TopPOptions

    @property
    def target_mass(self) -> float:
        return self.options.p

    def select(self, layer, q, cache, positions):
        B, Hq, _, D = q.shape
        kv_len = max(self.host_positions(positions)) + 1
        keys, _ = cache.keys(layer, kv_len)
        Hkv = keys.shape[1]
        logits = (q.view(B, Hkv, Hq // Hkv, D).float() @ keys.float().transpose(-1, -2)) * D**-0.5  # [B, Hkv, G, S]
        slots = torch.arange(kv_len, device=q.device)
        logits = logits.masked_fill((slots > positions.view(B, 1, 1, 1)), float("-inf"))
        chosen = top_p_mask(logits.softmax(-1), self.options.p).any(2)  # union over the group
        chosen &= slots <= positions.view(B, 1, 1)  # zero-probability slots can pass a p = 1 threshold
        return mask_to_indices(chosen | forced_slots(self.options, positions, kv_len))

    def decode(self, layer, q, cache, positions):
        idx, valid = self.select(layer, q, cache, positions)
        self.count_attended(valid.sum(-1))
        return attend_selected(q, cache.k[layer], cache.v[layer], idx, valid)


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-vector (last dim) asymmetric min/max quantisation to `bits` bits, dequantised back to fp32."""
    x = x.float()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-12)
    return torch.round((x - lo) / scale) * scale + lo


class Twilight(OracleTopP):
    name = "twilight"
    Options = TwilightOptions

    def __init__(self, options: TwilightOptions | None = None):
        super().__init__(options)
        from . import POLICIES, make_policy  # the registry imports this module

        o = self.options
        if not issubclass(POLICIES.get(o.base, SelectionPolicy), SelectionPolicy):  # (an unknown name: make_policy)
            raise SparseSpecError(f"twilight needs a selection policy as its base, not {o.base!r}")
        self.base = make_policy(o.base, {"budget": str(o.candidates), "dense_layers": str(o.dense_layers),
                                         "sinks": str(o.sinks), "window": str(o.window),
                                         "min_tokens": str(o.min_tokens)})

    @contextmanager
    def stepping(self, positions):
        with super().stepping(positions), self.base.stepping(positions):
            yield

    def build(self, layer, cache, lengths):
        self.base.build(layer, cache, lengths)

    def append(self, layer, cache, lengths):
        self.base.append(layer, cache, lengths)

    def select(self, layer, q, cache, positions):
        B, Hq, _, D = q.shape
        cand, cand_valid = self.base.select(layer, q, cache, positions)  # [B, Hkv, K]
        Hkv = cand.shape[1]
        keys = cache.k[layer].gather(2, cand.unsqueeze(-1).expand(-1, -1, -1, D))  # [B, Hkv, K, D]
        estimate = fake_quantize(keys, self.options.bits)
        logits = (q.view(B, Hkv, Hq // Hkv, D).float() @ estimate.transpose(-1, -2)) * D**-0.5  # [B, Hkv, G, K]
        logits = logits.masked_fill(~cand_valid[:, :, None], float("-inf"))
        keep = top_p_mask(logits.softmax(-1), self.options.p).any(2) & cand_valid  # [B, Hkv, K]
        kv_len = max(self.host_positions(positions)) + 1
        chosen = selection_mask(cand, keep, kv_len)
        return mask_to_indices(chosen | forced_slots(self.options, positions, kv_len))
