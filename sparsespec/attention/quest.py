"""Quest: query-aware page selection from per-page key bounds.

The cache is cut into pages of `page` consecutive slots. Per (row, layer, KV head) and page, the index keeps the
elementwise min and max of the page's committed keys. For a query q the page bound

    Σ_d max(q_d · min_d, q_d · max_d)  =  q⁺ · max + q⁻ · min          (q⁺ = max(q, 0), q⁻ = min(q, 0))

is an upper bound of q·k for every key k of the page. The bounds of a KV head's query heads are summed (GQA as
Quest does it). A step selects whole pages, as Quest does: the query's own page, the pages holding the sinks and
the recent window, then the best-bound pages until the budget is filled (rounded up to whole pages: at least the
budget's tokens are attended); it attends to every slot of them up to the query.

    page_extrema                 (build at prefill; append after every commit or rollback)
    page_bounds -> sum           (decode: one key a page; the page of the last committed token refreshed first)
    select_topk over pages -> expand_pages -> exact attention

`scores` gives every slot its page's bound (-inf past the committed length), for analysis; the selection itself
works on pages, 16x fewer keys than slots at the default page.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache import KVCache
from ..errors import SparseSpecError
from .policy import BudgetOptions, SelectionPolicy, device_ints, option


MAX_PAGE = 4096  # tokens


@dataclass(frozen=True)
class QuestOptions(BudgetOptions):
    page: int = option(16, "tokens per page (pages are scored by their keys' min/max bounds)")

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.page <= MAX_PAGE:  # (a page is padded whole at every update: a huge one only costs)
            raise SparseSpecError(f"page must be in [1, {MAX_PAGE}] tokens, got {self.page}")


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

    # A step's selection, on pages: select_topk's arguments in page units, then the pages' slots.
    def page_args(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [B] -> [3, B] int32: each row's own page (the last that exists), its budget in pages, and
        the first page of its recent window (forced in from there on, its own page included). The budget in
        pages holds at least the budget in tokens, counting the query's own page only up to the query."""
        page, pos = self.options.page, positions.long()
        budget = -(-(self.options.tokens_on_device(pos + 1) + page - 1 - pos % page) // page)
        recent = (pos - max(self.options.window, 1) + 1).clamp_min(0) // page
        return torch.stack([pos // page, budget, recent]).int()

    def page_width(self, position: int) -> int:
        """The most pages a query at `position` selects (budget or forced pages, whichever is more)."""
        page, window = self.options.page, max(self.options.window, 1)
        forced = -(-self.options.sinks // page) + (window + page - 2) // page + 1
        return min(position // page + 1, max(-(-(self.options.tokens(position + 1) + page - 1) // page), forced))

    def select_pages(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor,
                     args: torch.Tensor, pages: int, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     scratch: torch.Tensor | None = None):
        """q [B, Hq, 1, D] -> (pages [B*Hkv, pages] int32 in page order, count [B*Hkv] int32); the extrema of the
        page of each row's last committed token are refreshed first. Triton kernels on CUDA (`scratch`: the
        select's counting buffers, a plan's), references else."""
        from ..kernels import triton_ready
        from ..kernels.scores import quest_keys, quest_keys_ref
        from ..kernels.select import select_topk, select_topk_ref

        state: QuestState = cache.policy_state[layer]
        B, Hq, _, D = q.shape
        fast = triton_ready(q.device)
        if fast:
            keys = quest_keys(q.view(B, Hq, D), cache.k[layer], state.kmin, state.kmax, positions, self.options.page)
        else:  # the pages up to the furthest query only (views: the refresh still lands in the index)
            n = min(state.kmin.shape[2], max(self.host_positions(positions)) // self.options.page + 1)
            keys = quest_keys_ref(q.view(B, Hq, D), cache.k[layer], state.kmin[:, :, :n], state.kmax[:, :, :n],
                                  positions, self.options.page)  # [B*Hkv, n]
        sel = (keys, args[0], args[1], args[2], pages, 32)
        opts = dict(sinks=-(-self.options.sinks // self.options.page), window=1)
        if fast:
            return select_topk(*sel, out=out, scratch=scratch, **opts)
        idx, count = select_topk_ref(*sel, **opts)
        if out is not None:
            out[0].copy_(idx)
            out[1].copy_(count)
        return idx, count

    def select(self, layer, q, cache, positions):
        from ..kernels.select import expand_pages_ref

        B, Hkv = q.shape[0], cache.k[layer].shape[1]
        pages = max(self.page_width(p) for p in self.host_positions(positions))
        idx, count = self.select_pages(layer, q, cache, positions, self.page_args(positions), pages)
        idx, count = expand_pages_ref(idx, count, positions, self.options.page, pages * self.options.page)
        valid = torch.arange(idx.shape[1], device=idx.device) < count[:, None].long()
        return idx.long().view(B, Hkv, -1), valid.view(B, Hkv, -1)

    def fixed_width(self, capacity: int, lengths: list[int]) -> int:
        return min(capacity, self.page_width(capacity - 1) * self.options.page)

    def plan_fixed(self, cache, lengths):
        super().plan_fixed(cache, lengths)
        R, B = cache.batch * cache.k[0].shape[1], cache.batch
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int32, device=cache.device)  # noqa: E731
        self.pages = (zeros(R, self.page_width(cache.capacity - 1)), zeros(R))  # a step's page selection
        self.step_args = zeros(3, B)  # page_args of the step, shared by its layers

    def begin_step(self, positions):
        super().begin_step(positions)
        if not self.fixed.reusing:
            self.step_args.copy_(self.page_args(positions))

    def fixed_selection(self, layer, q, cache, into=None):
        from ..kernels import triton_ready
        from ..kernels.select import expand_pages, expand_pages_ref

        plan = self.fixed
        into = plan.buffers(layer) if into is None else into
        pages, count = self.select_pages(layer, q, cache, plan.positions, self.step_args, self.pages[0].shape[1],
                                         out=self.pages, scratch=plan.scratch)
        if triton_ready(q.device):
            return expand_pages(pages, count, plan.positions, self.options.page, into, plan.attended)
        return self.keep_selection(*expand_pages_ref(pages, count, plan.positions, self.options.page,
                                                     into[0].shape[1]), into)


def refresh_last_page(kmin: torch.Tensor, kmax: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      page: int) -> None:
    """Recompute, for every row at once, the extrema kmin / kmax [B, Hkv, NP, D] of the page holding slot
    positions[b] - 1 (the token the last step committed) from the cache k [B, Hkv, S, D]; device-side, so a
    captured step keeps the index current."""
    B, Hkv, S, D = k.shape
    last = (positions - 1).clamp_min(0)  # [B]
    slots = (last // page * page)[:, None] + torch.arange(page, device=k.device)  # [B, page]
    keep = (slots < positions[:, None])[:, None, :, None]  # [B, 1, page, 1]
    keys = k.gather(2, slots.clamp_max(S - 1)[:, None, :, None].expand(B, Hkv, page, D))  # [B, Hkv, page, D]
    at = (last // page)[:, None, None, None].expand(B, Hkv, 1, D)
    kmin.scatter_(2, at, keys.masked_fill(~keep, float("inf")).amin(2, keepdim=True))
    kmax.scatter_(2, at, keys.masked_fill(~keep, float("-inf")).amax(2, keepdim=True))
