"""Quest: query-aware page selection from per-page key bounds.

The cache is cut into pages of `page` consecutive slots. Per (row, layer, KV head) and page, the index keeps the
elementwise min and max of the page's committed keys. For a query q the page bound

    Σ_d max(q_d · min_d, q_d · max_d)  =  q⁺ · max + q⁻ · min          (q⁺ = max(q, 0), q⁻ = min(q, 0))

is an upper bound of q·k for every key k of the page. The bounds of a KV head's query heads are summed (GQA as
Quest does it), and every slot takes its page's score, so the top-k slots are the top pages.

    page_extrema          (build at prefill; append after every commit or rollback)
    page_bounds -> sum    (decode)

Slots past a row's committed length are not in the index and score -inf (a page with no committed slot is never
chosen); the current token's slot is forced in by select_top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import SparseSpecError
from .policy import PolicyOptions, SelectKeys, SelectionPolicy, device_ints, option


@dataclass(frozen=True)
class QuestOptions(PolicyOptions):
    page: int = option(16, "tokens per page (pages are scored by their keys' min/max bounds)")

    def __post_init__(self):
        super().__post_init__()
        if self.page < 1:
            raise SparseSpecError(f"page must be >= 1, got {self.page}")


def page_extrema(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., N, D] (slots of whole pages from a page start; the last page may be partial)
    -> (min, max) [..., ceil(N / page), D] over each page's slots."""
    n = keys.shape[-2]
    pages = -(-n // page)
    pad = pages * page - n
    shape = (*keys.shape[:-2], pages, page, keys.shape[-1])
    lo = F.pad(keys, (0, 0, 0, pad), value=float("inf")).view(shape).amin(-2)
    hi = F.pad(keys, (0, 0, 0, pad), value=float("-inf")).view(shape).amax(-2)
    return lo, hi


def page_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q [..., G, D], kmin/kmax [..., P, D] -> [..., G, P]: per query head, Σ_d max(q_d·min_d, q_d·max_d),
    an upper bound of q·k over the keys of each page."""
    return q.clamp(min=0) @ kmax.transpose(-1, -2) + q.clamp(max=0) @ kmin.transpose(-1, -2)


@dataclass
class QuestState:
    kmin: torch.Tensor  # [B, Hkv, n_pages, D] key dtype
    kmax: torch.Tensor  # [B, Hkv, n_pages, D]
    committed: list[int]  # slots [0, committed[b]) of row b are summarised; later pages hold stale values


class Quest(SelectionPolicy):
    name = "quest"
    Options = QuestOptions

    def build(self, layer, cache, lengths):
        if not self.is_sparse(layer):
            return
        k = cache.k[layer]  # [B, Hkv, S, D]
        B, Hkv, S, D = k.shape
        n_pages = -(-S // self.options.page)
        state = QuestState(kmin=torch.zeros(B, Hkv, n_pages, D, dtype=k.dtype, device=k.device),
                           kmax=torch.zeros(B, Hkv, n_pages, D, dtype=k.dtype, device=k.device),
                           committed=[0] * B)
        for b, n in enumerate(lengths):
            self._update(state, k, b, 0, n)
        cache.policy_state[layer] = state

    def append(self, layer, cache, lengths):
        state: QuestState | None = cache.policy_state[layer]
        if state is None:
            return
        for b, n in enumerate(lengths):
            if n != state.committed[b]:
                # Growth refreshes the pages from the old end on; a rollback refreshes the page it now ends in.
                self._update(state, cache.k[layer], b, min(state.committed[b], n), n)

    def _update(self, state: QuestState, k: torch.Tensor, row: int, start: int, end: int) -> None:
        """Recompute the pages holding slots [start, end) of `row` from the cache; `end` becomes its length."""
        page = self.options.page
        first = start // page
        if end > first * page:
            lo, hi = page_extrema(k[row, :, first * page:end], page)  # [Hkv, P, D]
            state.kmin[row, :, first:first + lo.shape[1]] = lo
            state.kmax[row, :, first:first + hi.shape[1]] = hi
        state.committed[row] = end

    def scores(self, layer, q, cache, positions):
        state: QuestState = cache.policy_state[layer]
        page = self.options.page
        B, Hq, _, D = q.shape
        Hkv = state.kmin.shape[1]
        kv_len = max(self.host_positions(positions)) + 1
        n_pages = -(-kv_len // page)
        qg = q.view(B, Hkv, Hq // Hkv, D).float()  # [B, Hkv, G, D]
        bounds = page_bounds(qg, state.kmin[:, :, :n_pages].float(), state.kmax[:, :, :n_pages].float())
        per_page = bounds.sum(2)  # [B, Hkv, P]: GQA-summed
        scores = per_page.repeat_interleave(page, dim=-1)[..., :kv_len]  # [B, Hkv, S]
        slots = torch.arange(kv_len, device=q.device)
        committed = device_ints(state.committed, q.device).view(B, 1, 1)
        return scores.masked_fill(slots >= committed, float("-inf"))

    def fixed_keys(self, layer, q, cache):
        from ..kernels import triton_ready
        from ..kernels.scores import quest_keys, quest_keys_ref

        state: QuestState = cache.policy_state[layer]
        positions = self.fixed.positions.long()  # [B]: slots [0, position) are committed
        refresh_last_page(state, cache.k[layer], positions, self.options.page)
        B, Hq, _, D = q.shape
        keys = (quest_keys if triton_ready(q.device) else quest_keys_ref)(
            q.view(B, Hq, D), state.kmin, state.kmax, self.fixed.positions, self.options.page, cache.capacity)
        return SelectKeys(keys, 32)


def refresh_last_page(state: QuestState, k: torch.Tensor, positions: torch.Tensor, page: int) -> None:
    """Recompute, for every row at once, the extrema of the page holding slot positions[b] - 1 (the token the last
    step committed) from the cache k [B, Hkv, S, D]; device-side, so a captured step keeps the index current."""
    B, Hkv, S, D = k.shape
    last = (positions - 1).clamp_min(0)  # [B]
    slots = (last // page * page)[:, None] + torch.arange(page, device=k.device)  # [B, page]
    keep = (slots < positions[:, None])[:, None, :, None]  # [B, 1, page, 1]
    keys = k.gather(2, slots.clamp_max(S - 1)[:, None, :, None].expand(B, Hkv, page, D))  # [B, Hkv, page, D]
    at = (last // page)[:, None, None, None].expand(B, Hkv, 1, D)
    state.kmin.scatter_(2, at, keys.masked_fill(~keep, float("inf")).amin(2, keepdim=True))
    state.kmax.scatter_(2, at, keys.masked_fill(~keep, float("-inf")).amax(2, keepdim=True))
