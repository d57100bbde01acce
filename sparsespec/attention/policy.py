"""The sparse-attention policy interface, and the shared "select key positions -> exact attention" machinery.

A policy sees the static KV cache layer by layer:

    build(layer, cache, lengths)     end of prefill: make its index from the prefill keys (cache.policy_state)
    append(layer, cache, lengths)    after decoded tokens are committed (lengths = new row lengths)
    decode(layer, q, cache, plan)    one decode step: the attention output [B, Hq, 1, D]

Prefill stays dense. The first `dense_layers` layers stay dense. Selection policies only implement `scores`
(one score per cache slot and KV head, higher = more important); the base class adds the options every policy
shares — sink tokens, a recent window, the budget — takes the top-k per (row, KV head) and attends exactly to
that set. GQA: one selection per KV head, shared by its query heads (policies combine the group's scores).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..cache import KVCache
from ..errors import SparseSpecError


@dataclass(frozen=True)
class PolicyOptions:
    """Options every policy shares. `budget` ≤ 1 is a fraction of the context (0.02 = 2%); a larger value is a
    token count. The budget counts every attended token: sinks, window and the current token included."""

    budget: float = 0.02
    min_tokens: int = 0
    dense_layers: int = 2
    sinks: int = 0
    window: int = 0

    def __post_init__(self):
        if not 0 < self.budget < float("inf"):
            raise SparseSpecError(f"budget must be a positive finite number, got {self.budget}")
        if self.budget > 1 and self.budget != int(self.budget):
            raise SparseSpecError(f"a budget above 1 is a token count and must be an integer, got {self.budget}")
        for name in ("min_tokens", "dense_layers", "sinks", "window"):
            if getattr(self, name) < 0:
                raise SparseSpecError(f"{name} must be >= 0, got {getattr(self, name)}")

    def tokens(self, context: int) -> int:
        """How many of `context` tokens one decode query attends to."""
        k = round(self.budget * context) if self.budget <= 1 else int(self.budget)
        return max(1, min(context, max(k, self.min_tokens)))


def parse_options(cls: type[PolicyOptions], pairs: list[str] | dict[str, Any]) -> PolicyOptions:
    """`key=value` strings (or a dict) -> a validated options dataclass; unknown keys are an error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    items = pairs.items() if isinstance(pairs, dict) else [_split_pair(p) for p in pairs]
    for key, raw in items:
        if key not in fields:
            raise SparseSpecError(f"unknown attention option {key!r} (known: {', '.join(fields)})")
        default = fields[key].default
        try:
            if isinstance(default, bool):
                if str(raw).lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                values[key] = str(raw).lower() in ("true", "1")
            elif isinstance(default, int):
                values[key] = int(raw)
            elif isinstance(default, float):
                values[key] = float(raw)
            else:
                values[key] = raw
        except ValueError:
            raise SparseSpecError(f"invalid value {raw!r} for attention option {key!r}") from None
    return cls(**values)


def _split_pair(pair: str) -> tuple[str, str]:
    if "=" not in pair:
        raise SparseSpecError(f"attention option must be key=value, got {pair!r}")
    key, value = pair.split("=", 1)
    return key.strip(), value.strip()


class Policy(ABC):
    """A decode-attention method. Layers below `dense_layers` (and every prefill) stay dense."""

    name: ClassVar[str]
    Options: ClassVar[type[PolicyOptions]] = PolicyOptions

    def __init__(self, options: PolicyOptions | None = None):
        self.options = options if options is not None else self.Options()
        self.reset_attended()

    def reset_attended(self) -> None:
        self._attended_sum: torch.Tensor | float = 0.0
        self._attended_steps = 0

    def count_attended(self, keys: torch.Tensor) -> None:
        """Record keys attended [B, Hkv] by one sparse decode step (summed on device: no synchronisation)."""
        self._attended_sum = self._attended_sum + keys.float().mean()
        self._attended_steps += 1

    @property
    def mean_attended(self) -> float | None:
        """Mean keys attended per KV head over the sparse steps since the last reset (None before the first)."""
        return float(self._attended_sum) / self._attended_steps if self._attended_steps else None

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.options.dense_layers

    def build(self, layer: int, cache: KVCache, lengths: list[int]) -> None:
        """End of prefill: `cache` holds slots [0, lengths[b]) of every row."""

    def append(self, layer: int, cache: KVCache, lengths: list[int]) -> None:
        """Slots [0, lengths[b]) are now committed (after each decode step; smaller after a rollback)."""

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, 1, D] of the tokens at `positions` [B] (already in the cache) -> output [B, Hq, 1, D]."""


class SelectionPolicy(Policy):
    """Policies that choose key positions; attention over the chosen set is exact."""

    @abstractmethod
    def scores(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, 1, D] at `positions` [B] -> importance [B, Hkv, max(positions) + 1] (fp32; +inf forces a
        slot in, -inf keeps it out)."""

    def select(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor):
        """-> (indices [B, Hkv, K] int64, valid [B, Hkv, K] bool): the slots each (row, KV head) attends to."""
        return select_top(self.scores(layer, q, cache, positions), positions, self.options)

    def decode(self, layer, q, cache, positions):
        idx, valid = self.select(layer, q, cache, positions)
        self.count_attended(valid.sum(-1))
        return attend_selected(q, cache.k[layer], cache.v[layer], idx, valid)


def forced_slots(opts: PolicyOptions, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """bool [B, 1, kv_len]: the sinks, the recent window and the current token of each row (none past it)."""
    slots = torch.arange(kv_len, device=positions.device)
    pos = positions.view(-1, 1, 1)
    return ((slots < opts.sinks) | (slots > pos - max(opts.window, 1))) & (slots <= pos)


def select_top(scores: torch.Tensor, positions: torch.Tensor, opts: PolicyOptions):
    """scores [B, Hkv, S] -> the top slots per (row, KV head) within the budget, with sinks, the recent window and
    the current token forced in, and slots past each row's position or scored -inf kept out. Forced slots beyond
    the budget are all kept (the budget grows to hold them). Returns (indices [B, Hkv, K], valid [B, Hkv, K])."""
    B, _, S = scores.shape
    slots = torch.arange(S, device=scores.device)
    pos = positions.view(B, 1, 1)
    scores = scores.float().masked_fill(forced_slots(opts, positions, S), float("inf"))
    scores = scores.masked_fill(slots > pos, float("-inf"))
    n_forced = (scores == float("inf")).sum(-1).amax(-1)  # [B]
    budget = torch.tensor([opts.tokens(int(p) + 1) for p in positions.tolist()], device=scores.device)
    budget = torch.maximum(budget, n_forced)  # [B]
    idx = torch.topk(scores, int(budget.max()), dim=-1).indices  # [B, Hkv, K]
    in_budget = torch.arange(idx.shape[-1], device=scores.device) < budget.view(B, 1, 1)
    return idx, in_budget & (scores.gather(-1, idx) > float("-inf"))


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """Exact attention over the gathered slots. q [B, Hq, 1, D], k/v [B, Hkv, S, D], idx/valid [B, Hkv, K]
    -> [B, Hq, 1, D]."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    gather = idx.unsqueeze(-1).expand(-1, -1, -1, D)
    ks, vs = k.gather(2, gather), v.gather(2, gather)  # [B, Hkv, K, D]
    qg = q.view(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
    logits = (qg.float() @ ks.float().transpose(-1, -2)) * D**-0.5  # [B, Hkv, G, K], fp32 like SDPA's accumulation
    probs = logits.masked_fill(~valid.unsqueeze(2), float("-inf")).softmax(-1)
    return (probs.to(vs.dtype) @ vs).view(B, Hq, 1, D)


def group_max(per_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, S] -> [B, Hkv, S]: the max over each KV head's query group."""
    B, Hq, S = per_head.shape
    return per_head.view(B, num_kv_heads, Hq // num_kv_heads, S).amax(2)
