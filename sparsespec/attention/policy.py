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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..cache import KVCache
from ..errors import SparseSpecError, number, whole


def option(default: Any, help: str) -> Any:
    """An options field with its one-line description (`sparsespec policies` prints it)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SelectKeys:
    """A fixed-width step's selection keys of one layer, as `select_topk` takes them: keys [B * Hkv, S] int16/int32
    of `key_bits` bits; slots from forced_from [B] on forced (None: after the query); a forced list extra
    [B * Hkv, E] of which extra_n [B] count, for the select to write (None where there is none, or where the scorer
    wrote it into the keys itself: BinaryPC's kernels); the sampled slots' keys beside them (`select_topk(samples=)`),
    if the scorer wrote them."""
    keys: torch.Tensor
    key_bits: int
    forced_from: torch.Tensor | None = None
    extra: torch.Tensor | None = None
    extra_n: torch.Tensor | None = None
    samples: torch.Tensor | None = None


@dataclass(frozen=True)
class PolicyOptions:
    """Options every policy shares."""

    dense_layers: int = option(2, "the first N layers decode with dense attention")
    sinks: int = option(0, "the first N tokens (attention sinks) are always attended")
    window: int = option(0, "the N most recent tokens are always attended")
    select_every: int = option(1, "select the keys at every N-th decode step only; the steps between attend to "
                                  "each layer's last selection plus the tokens decoded since (cheaper steps, e.g. "
                                  "a self-drafter's; fixed-width steps of the engine's runner; 1: every step)")

    def __post_init__(self):
        for name in ("dense_layers", "sinks", "window"):
            if getattr(self, name) < 0:
                raise SparseSpecError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.select_every < 1:
            raise SparseSpecError(f"select_every must be >= 1, got {self.select_every}")

    def forced(self, position: int) -> int:
        """How many slots `forced_slots` forces in for a query at `position`."""
        sinks, recent_from = min(self.sinks, position + 1), max(0, position - max(self.window, 1) + 1)
        return sinks + position + 1 - recent_from - max(0, sinks - recent_from)


@dataclass(frozen=True)
class SelectionOptions(PolicyOptions):
    """Options of the policies that attend a budget of keys a step (`SelectionPolicy`). `budget` ≤ 1 is a fraction
    of the context (0.02 = 2%); a larger value is a token count. The budget counts every attended token: sinks,
    window and the current token included. (The top-p policies attend by attention mass instead: no budget.)"""

    budget: float = option(0.02, "keys attended per step: a share of the context if <= 1 (0.02 = 2%), else a count")
    min_tokens: int = option(256, "attend at least this many keys whatever the budget, so a short context is not "
                                   "cut to a handful of keys (docs/results/token_floor.md)")

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.budget < float("inf"):
            raise SparseSpecError(f"budget must be a positive finite number, got {self.budget}")
        if self.budget > 1 and self.budget != int(self.budget):
            raise SparseSpecError(f"a budget above 1 is a token count and must be an integer, got {self.budget}")
        if self.min_tokens < 0:
            raise SparseSpecError(f"min_tokens must be >= 0, got {self.min_tokens}")

    def tokens(self, context: int) -> int:
        """How many of `context` tokens one decode query attends to."""
        k = round(self.budget * context) if self.budget <= 1 else int(self.budget)
        return max(1, min(context, max(k, self.min_tokens)))

    def tokens_on_device(self, context: torch.Tensor) -> torch.Tensor:
        """`tokens` for each context [B] (int64), computed where the tensor lives (no read-back)."""
        k = torch.round(self.budget * context.double()).long() if self.budget <= 1 else torch.full_like(
            context, int(self.budget))
        return torch.minimum(context, k.clamp_min(self.min_tokens)).clamp_min(1)


@dataclass(frozen=True)
class BudgetOptions(SelectionOptions):
    """The defaults of the fixed-budget selection policies (oracle top-k, BinaryPC, Quest, Double Sparsity): 4 sink
    tokens and a 64-token recent window inside the budget, and a floor of 1024 keys, so that 2% holds up below 51k
    tokens. Measured: at 1024 tokens with these sinks and window, top-k and BinaryPC match Double-P's accuracy and
    come within 2.6 / 4.1 points of oracle top-p 0.9 at 4k-32k on qwen2.5-coder-0.5b and 1.5 / 1.9 on the 1.5B
    (docs/results/eval.md, the fair tables), where 2% with a 256-key floor scored up to 3.3 points lower than 1024
    tokens (BinaryPC, 0.5B, 4k); over long generations (docs/results/longgen.md) the larger floor kept BinaryPC on
    dense's text and Quest from stopping early."""

    min_tokens: int = option(1024, "attend at least this many keys whatever the budget (docs/results/eval.md, "
                                   "longgen.md)")
    sinks: int = option(4, "the first N tokens (attention sinks) are always attended")
    window: int = option(64, "the N most recent tokens are always attended")


def parse_options(cls: type[PolicyOptions], pairs: list[str] | dict[str, Any]) -> PolicyOptions:
    """`key=value` strings (or a dict) -> a validated options dataclass; unknown keys, and a key given twice (inline
    and in --attention-opt alike: which one was meant?), are an error."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    items = pairs.items() if isinstance(pairs, dict) else [_split_pair(p) for p in pairs]
    for key, raw in items:
        if key not in fields:
            raise SparseSpecError(f"unknown attention option {key!r} (known: {', '.join(fields)})")
        if key in values:
            raise SparseSpecError(f"attention option {key!r} given twice")
        default = fields[key].default
        if not isinstance(raw, str) and not _of_type(raw, default):  # (a dict's value: its type, not a cast)
            raise SparseSpecError(f"invalid value {raw!r} for attention option {key!r}: it takes "
                                  f"{'a bool' if isinstance(default, bool) else type(default).__name__ + 's'}")
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


def _of_type(value: Any, default: Any) -> bool:
    """Whether a value given as itself (not as text) has the type of an option's default: bools for bools, whole
    numbers for ints, numbers for floats (no bool for a number)."""
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return whole(value)
    if isinstance(default, float):
        return number(value)
    return True


def _split_pair(pair: str) -> tuple[str, str]:
    if "=" not in pair:
        raise SparseSpecError(f"attention option must be key=value, got {pair!r}")
    key, value = pair.split("=", 1)
    return key.strip(), value.strip()


@dataclass
class FixedPlan:
    """Per-step metadata of fixed-width sparse steps, built once per step (inside a captured graph) and read by
    every sparse layer: the selection width is static, everything that changes lives on the device."""

    width: int  # K: selected slots per (row, KV head), the most any step up to the cache's capacity needs
    positions: torch.Tensor  # [B] int32: each row's query position
    after: torch.Tensor  # [B] int32: positions + 1, the select's forced_from where the keys give none
    tokens: torch.Tensor  # [B] int32: each row's budget (forced slots may take more, up to `width`)
    attended: torch.Tensor  # [B] fp32: keys attended per KV head, summed over the sparse layers of every step
    idx: torch.Tensor  # [B * Hkv, width] int32: the selection of the layer being run (reused by every layer)
    count: torch.Tensor  # [B * Hkv] int32
    listed: torch.Tensor  # [B] int32: how many of the policy's own forced list (`fixed_keys`) count this step
    scratch: torch.Tensor | None  # the Triton select's counting buffers (`select_scratch`), zero between selects
    # select_every > 1: every layer keeps its selection, idx [L, B * Hkv, width + select_every - 1] int32 and
    # count [L, B * Hkv] int32 (room for the slots decoded until the next selection); layers from `first_sparse`
    kept: tuple[torch.Tensor, torch.Tensor] | None = None
    first_sparse: int = 0
    reusing: bool = False  # the step (when run or captured) attends to the kept selections instead of selecting
    block: bool = False  # the step is a block pass (`Policy.block`, even of one token): a reusing one reads the
    #                      kept selections as their selecting block made them, and the slots after `selected_at`
    selected_at: torch.Tensor | None = None  # [B] int32 with kept selections: each row's last selecting position
    keep: torch.Tensor | None = None  # [B] bool with kept selections: rows whose selecting block keeps their old one

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where layer `layer`'s selection goes: (idx [B * Hkv, W] int32, count [B * Hkv] int32); W >= width."""
        return (self.idx, self.count) if self.kept is None else (self.kept[0][layer], self.kept[1][layer])


def _copy_row(state: Any, one: Any, row: int) -> None:
    """Copy a one-row index `one` into row `row` of the batch's `state` (see `Policy.build_row`)."""
    if not dataclasses.is_dataclass(state):
        return  # None, or shared by every row
    for f in dataclasses.fields(state):
        batch, single = getattr(state, f.name), getattr(one, f.name)
        if isinstance(batch, torch.Tensor):
            batch[row].copy_(single[0])
        elif isinstance(batch, list):
            batch[row] = single[0]


class Policy(ABC):
    """A decode-attention method. Layers below `dense_layers` (and every prefill) stay dense."""

    name: ClassVar[str]
    Options: ClassVar[type[PolicyOptions]] = PolicyOptions
    graphable: ClassVar[bool] = False  # fixed-width steps without host synchronisation (a CUDA graph can hold them)
    blocks: ClassVar[bool] = False  # `block`: a block of queries over its first query's selection (a cascade's pass)
    blocking = False  # a one-token step is a block pass (`SelectionPolicy.blocking`), not `decode`
    row_index: ClassVar[bool] = True  # `build_row` rebuilds one row's index inside the batch's (continuous batching)

    def __init__(self, options: PolicyOptions | None = None):
        self.options = options if options is not None else self.Options()
        self.step_positions: list[int] | None = None
        self.fixed: FixedPlan | None = None
        self.reset_attended()

    @contextmanager
    def stepping(self, positions: list[int]) -> Iterator[None]:
        """Within: every decode query is at `positions` (per row; a decode step's `cache.lengths`), so the policy
        sizes its work from these Python ints instead of reading the positions back (a wait for the device)."""
        self.step_positions = list(positions)
        try:
            yield
        finally:
            self.step_positions = None

    def host_positions(self, positions: torch.Tensor) -> list[int]:
        """positions [B] as Python ints: those announced by `stepping`, else read back."""
        return self.step_positions if self.step_positions is not None else positions.tolist()

    def reset_attended(self) -> None:
        self._attended_sum: torch.Tensor | float = 0.0  # [B] once a sparse step ran
        self._attended_steps = 0
        if self.fixed is not None:
            self.fixed.attended.zero_()

    def end_fixed(self) -> None:
        """Back to eager steps (fixed-width ones are planned by graphable policies' `plan_fixed`)."""
        self.fixed = None

    def stepped(self, layers: int) -> None:
        """A fixed-width step ran `layers` sparse layers (a graph replay runs no Python to count them)."""
        self._attended_steps += layers

    def count_attended(self, keys: torch.Tensor) -> None:
        """Record keys attended [B, Hkv] by one sparse decode step (summed per row on device: no synchronisation)."""
        self._attended_sum = self._attended_sum + keys.float().mean(-1)
        self._attended_steps += 1

    @property
    def attended(self) -> tuple[torch.Tensor | float, int]:
        """(keys attended per KV head summed over the sparse steps since the last reset, per row [B]; those
        steps). Every step makes a new sum tensor, so a kept pair is a snapshot (no synchronisation)."""
        if self.fixed is not None:
            return self.fixed.attended.clone(), self._attended_steps
        return self._attended_sum, self._attended_steps

    @property
    def mean_attended(self) -> float | None:
        """Mean keys attended per KV head over the rows and sparse steps since the last reset (None before the
        first)."""
        total, steps = self.attended
        return float(torch.as_tensor(total).mean()) / steps if steps else None

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.options.dense_layers

    def sparse_layers(self, num_layers: int) -> int:
        """How many of a model's `num_layers` layers decode sparsely; a `dense_layers` beyond them is refused."""
        if self.options.dense_layers > num_layers:
            raise SparseSpecError(f"dense_layers must be <= the model's {num_layers} layers, got "
                                  f"{self.options.dense_layers}")
        return sum(self.is_sparse(i) for i in range(num_layers))

    def build(self, layer: int, cache: KVCache, lengths: list[int]) -> None:
        """End of prefill: `cache` holds slots [0, lengths[b]) of every row."""

    def build_all(self, cache: KVCache, lengths: list[int]) -> None:
        """`build` for every layer of the cache (what a prefill is followed by)."""
        for layer in range(len(cache.k)):
            self.build(layer, cache, lengths)

    def build_row(self, cache: KVCache, row: int, length: int) -> None:
        """Continuous batching: (re)build row `row`'s index, every layer, from its `length` committed slots; the
        other rows' indexes are kept. The batch's index must exist (`build_all`). A row's index is what the row
        alone would get: built on a one-row view of the cache, then copied into the batch's state in place (a
        captured graph keeps reading it). States are None, tensors shared by every row (kept), or dataclasses whose
        tensor and list fields are per row, batch first."""
        view = cache.rows(row, row + 1)
        for layer in range(len(cache.k)):
            self.build(layer, view, [length])
            _copy_row(cache.policy_state[layer], view.policy_state[layer], row)

    def append(self, layer: int, cache: KVCache, lengths: list[int]) -> None:
        """Slots [0, lengths[b]) are now committed (after each decode step; smaller after a rollback)."""

    def append_all(self, cache: KVCache, lengths: list[int]) -> None:
        """`append` for every layer of the cache (a step or a rollback moves every layer's length at once)."""
        for layer in range(len(cache.k)):
            self.append(layer, cache, lengths)

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, 1, D] of the tokens at `positions` [B] (already in the cache) -> output [B, Hq, 1, D]."""


class SelectionPolicy(Policy):
    """Policies that choose key positions, a budget of them a step (`SelectionOptions`); attention over the chosen
    set is exact."""

    Options: ClassVar[type[SelectionOptions]] = SelectionOptions
    options: SelectionOptions

    @abstractmethod
    def scores(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, 1, D] at `positions` [B] -> importance [B, Hkv, max(positions) + 1] (fp32; +inf forces a
        slot in, -inf keeps it out)."""

    def scored_in(self, layer: int, cache: KVCache, positions: list[int]) -> list[int]:
        """Per row, at most how many slots up to its position `scores` scores +inf (none by default)."""
        return [0] * len(positions)

    def select(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor):
        """-> (indices [B, Hkv, K] int64, valid [B, Hkv, K] bool): the slots each (row, KV head) attends to."""
        scores = self.scores(layer, q, cache, positions)
        host = self.step_positions
        forced = None if host is None else [self.options.forced(p) + n for p, n in
                                             zip(host, self.scored_in(layer, cache, host))]
        return select_top(scores, positions, self.options, host, forced)

    def decode(self, layer, q, cache, positions):
        if self.fixed is not None:
            return self.decode_fixed(layer, q, cache)
        idx, valid = self.select(layer, q, cache, positions)
        self.count_attended(valid.sum(-1))
        return attend_selected(q, cache.k[layer], cache.v[layer], idx, valid)

    blocks = True

    @property
    def blocking(self) -> bool:
        """Whether a one-token step is a block pass (`block`; the runner's `sparse_verify` sets it), not `decode`."""
        return self.fixed is not None and self.fixed.block

    def block(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, T, D] of a block of T tokens at consecutive positions [B, T] (their K/V in the cache) -> output
        [B, Hq, T, D]. The block's first query selects as a decode step at its position would (fixed-width steps:
        into the plan's buffers, `begin_step` done for positions[:, 0]), and query t attends to that selection and
        the slots after it up to its own: what decode steps reusing the selection (`select_every`) attend to one
        after the other, in one pass (a cascade's sparse verify, `Runner.sparse_verify`). With kept selections
        (fixed width, select_every = N > 1) a row may reuse its layer's kept selection instead, made at
        `selected_at`, and attend to the slots after that one, all of its own within N − 1 of it (the caller's
        rule): every row in a reusing block (`plan.reusing`: nothing is selected), the rows of `plan.keep` in a
        selecting one (each row decides for itself, as it would alone). Exact attention: fixed-width, the Triton
        kernel over the selected count (`sparse_block_attention`) on CUDA, its torch reference otherwise; eager, a
        torch gather."""
        B, Hkv, T = q.shape[0], cache.k[layer].shape[1], q.shape[2]
        after, span = positions[:, 0], T - 1  # per row the selecting query's slot; how many slots after it count
        if self.fixed is not None:
            plan = self.fixed
            if plan.kept is not None:  # (`begin_step` set each row's `selected_at`)
                after, span = plan.selected_at.long(), max(T, self.options.select_every) - 1
            if plan.reusing:
                idx, count = plan.buffers(layer)  # [B * Hkv, W], [B * Hkv]
                plan.attended.add_(count.view(B, Hkv).float().mean(-1))
            elif plan.kept is not None:  # select aside, then keep it in the rows not in `keep`
                fresh = self.fixed_selection(layer, q[:, :, :1], cache, into=(plan.idx, plan.count))
                idx, count = plan.buffers(layer)  # [B * Hkv, W >= width], [B * Hkv]
                width = fresh[0].shape[1]  # (a fresh selection's columns past width are past its count)
                keep, kept_idx, kept_count = plan.keep.view(B, 1), idx.view(B, Hkv, -1)[..., :width], count.view(B, Hkv)
                torch.where(keep[..., None], kept_idx, fresh[0].view(B, Hkv, width), out=kept_idx)
                torch.where(keep, kept_count, fresh[1].view(B, Hkv), out=kept_count)
            else:
                idx, count = self.fixed_selection(layer, q[:, :, :1], cache)
            from ..kernels import triton_ready
            from ..kernels.attend import sparse_block_attention, sparse_block_attention_ref

            attend = sparse_block_attention if triton_ready(q.device) else sparse_block_attention_ref
            return attend(q, cache.k[layer], cache.v[layer], idx.view(B, Hkv, -1), count.view(B, Hkv), after,
                          positions, span)
        idx, valid = self.select(layer, q[:, :, :1], cache, positions[:, 0])  # [B, Hkv, K] each
        self.count_attended(valid.sum(-1))
        later = after[:, None] + 1 + torch.arange(span, device=q.device)  # [B, span]: the slots after the selection
        sees = later[:, None] <= positions[:, :, None]  # [B, T, span]: up to each query's own
        valid = torch.cat([valid[:, :, None].expand(B, Hkv, T, -1), sees[:, None].expand(B, Hkv, T, span)], -1)
        slots = torch.cat([idx, later.clamp(max=cache.capacity - 1)[:, None].expand(B, Hkv, span)], -1)
        return attend_selected(q, cache.k[layer], cache.v[layer], slots, valid)

    # ------------------------------------------------------------------------------------ fixed-width steps
    graphable = True

    def plan_fixed(self, cache: KVCache, lengths: list[int]) -> None:
        """After `build`: allocate the static buffers of fixed-width steps for this cache (their width covers every
        step up to the capacity); `decode` then takes the fixed-width path until `end_fixed`."""
        from ..kernels import triton_ready

        B, Hkv, S = cache.batch, cache.k[0].shape[1], cache.capacity
        width = self.fixed_width(S, lengths)
        zeros = lambda *shape, dtype=torch.int32: torch.zeros(shape, dtype=dtype, device=cache.device)  # noqa: E731
        every, layers = self.options.select_every, len(cache.k)
        kept = None if every == 1 else (zeros(layers, B * Hkv, width + every - 1), zeros(layers, B * Hkv))
        first = next((i for i in range(layers) if self.is_sparse(i)), layers)
        scratch = None  # the Triton select's counting buffers (the torch reference needs none)
        if triton_ready(cache.device):
            from ..kernels.select import select_scratch

            scratch = select_scratch(B * Hkv, cache.device)
        self.fixed = FixedPlan(width, zeros(B), zeros(B), zeros(B), zeros(B, dtype=torch.float32),
                               zeros(B * Hkv, width), zeros(B * Hkv), zeros(B), scratch, kept, first,
                               selected_at=None if kept is None else zeros(B),
                               keep=None if kept is None else zeros(B, dtype=torch.bool))

    def fixed_width(self, capacity: int, lengths: list[int]) -> int:
        """The selection width of fixed-width steps: the most slots any step up to `capacity` selects."""
        return min(capacity, max(self.options.tokens(capacity),
                                 self.options.forced(capacity - 1) + self.extra_forced(capacity, lengths)))

    def extra_forced(self, capacity: int, lengths: list[int]) -> int:
        """At most how many slots besides sinks and window the policy forces in at one step (bounds the width)."""
        return 0

    def begin_step(self, positions: torch.Tensor) -> None:
        """positions [B] of this step's queries -> the plan's device metadata (graph-capturable)."""
        plan = self.fixed
        plan.positions.copy_(positions)
        if plan.reusing:
            if not plan.block:  # (a block reads the slots after its selection from `selected_at`)
                self._keep_decoded(positions)
            return
        if plan.block and plan.kept is not None:  # a selecting block: where its selection stands, row by row
            plan.selected_at.copy_(torch.where(plan.keep, plan.selected_at, positions))
        torch.add(plan.positions, 1, out=plan.after)  # once a step, not once a layer (`fixed_selection`)
        plan.tokens.copy_(self.options.tokens_on_device(plan.after.long()))
        listed = self.listed_forced(plan.tokens)
        if listed is not None:
            plan.listed.copy_(listed)

    def _keep_decoded(self, positions: torch.Tensor) -> None:
        """A step that reuses the kept selections: each row's query slot joins every sparse layer's selection (the
        slots decoded since the selection are all there then; a full buffer keeps its last column for the newest)."""
        plan = self.fixed
        idx, count = (t[plan.first_sparse:] for t in plan.kept)  # [L', R, W], [L', R]
        L, R, W = idx.shape
        B = positions.shape[0]
        slot = positions.to(idx.dtype).repeat_interleave(R // B).expand(L, R)  # [L', R]
        idx.scatter_(2, count.clamp_max(W - 1).long()[..., None], slot[..., None])
        count.add_(1).clamp_(max=W)
        plan.attended.add_(count.view(L, B, R // B).float().mean(-1).sum(0))  # (L may be 0: every layer dense)

    def listed_forced(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Per row's budget [B], how many slots of the policy's own forced list a step takes (None: no list)."""
        return None

    def fixed_keys(self, layer: int, q: torch.Tensor, cache: KVCache) -> SelectKeys:
        """q [B, Hq, 1, D] -> the layer's selection keys. Default: the policy's scores over the whole capacity, in
        IEEE order."""
        from ..kernels.select import ordered_keys

        S = cache.capacity
        with self.stepping([S - 1] * cache.batch):
            scores = self.scores(layer, q, cache, self.fixed.positions.long())  # [B, Hkv, S]
        return SelectKeys(ordered_keys(scores).flatten(0, 1), 32)

    def fixed_selection(self, layer: int, q: torch.Tensor, cache: KVCache,
                        into: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, 1, D] -> the step's selection into `into` (default the plan's buffers of the layer,
        `FixedPlan.buffers`): (idx [B * Hkv, width] int32 in slot order, count [B * Hkv] int32), its mean count per
        row added to `attended`. Default: the policy's keys (`fixed_keys`), then radix top-k; the Triton kernel on
        CUDA, its torch reference otherwise."""
        from ..kernels import triton_ready

        plan = self.fixed
        into = plan.buffers(layer) if into is None else into  # [R, W], [R]: W >= width, no row selects more
        sk = self.fixed_keys(layer, q, cache)
        forced_from = plan.after if sk.forced_from is None else sk.forced_from
        args = (sk.keys, plan.positions, plan.tokens, forced_from, into[0].shape[1], sk.key_bits)
        opts = dict(sinks=self.options.sinks, window=self.options.window, extra=sk.extra, extra_n=sk.extra_n)
        if triton_ready(q.device):
            from ..kernels.select import select_topk

            return select_topk(*args, out=into, attended=plan.attended, scratch=plan.scratch, samples=sk.samples,
                               **opts)
        from ..kernels.select import select_topk_ref

        return self.keep_selection(*select_topk_ref(*args, **opts), into)

    def keep_selection(self, idx: torch.Tensor, count: torch.Tensor,
                       into: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A selection computed by a torch reference (idx [R, W], count [R]) -> the plan's buffers `into`, its mean
        count per row added to `attended` (what the Triton kernels do in place)."""
        into[0].copy_(idx)
        into[1].copy_(count)
        self.fixed.attended.add_(count.view(len(self.fixed.positions), -1).float().mean(-1))
        return into

    def decode_fixed(self, layer: int, q: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One sparse layer of a fixed-width step: the selection (`fixed_selection`; a reusing step takes the
        layer's kept one), then split-K attention over it. Triton kernels on CUDA, their torch references
        otherwise (the kernels' tests run them on CPU tensors in Triton's interpreter)."""
        from ..kernels import triton_ready
        from ..kernels.attend import sparse_decode_attention, sparse_decode_attention_ref

        plan = self.fixed
        B, Hq, _, D = q.shape
        Hkv = cache.k[layer].shape[1]
        idx, count = plan.buffers(layer) if plan.reusing else self.fixed_selection(layer, q, cache)
        attend = sparse_decode_attention if triton_ready(q.device) else sparse_decode_attention_ref
        out = attend(q.view(B, Hq, D).contiguous(), cache.k[layer], cache.v[layer], idx.view(B, Hkv, -1),
                     count.view(B, Hkv))
        return out.view(B, Hq, 1, D)


def forced_slots(opts: PolicyOptions, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    """bool [B, 1, kv_len]: the sinks, the recent window and the current token of each row (none past it)."""
    slots = torch.arange(kv_len, device=positions.device)
    pos = positions.view(-1, 1, 1)
    return ((slots < opts.sinks) | (slots > pos - max(opts.window, 1))) & (slots <= pos)


def select_top(scores: torch.Tensor, positions: torch.Tensor, opts: PolicyOptions, host: list[int] | None = None,
               forced: list[int] | None = None):
    """scores [B, Hkv, S] -> the top slots per (row, KV head) within the budget, with sinks, the recent window and
    the current token forced in, and slots past each row's position or scored -inf kept out. Forced slots beyond
    the budget are all kept (the budget grows to hold them). Returns (indices [B, Hkv, K], valid [B, Hkv, K]).

    K is the largest budget, read back from the device; given the positions as Python ints (`host`) and per row a
    bound on the slots scored +inf (`forced`), K is the largest bound instead (no read-back; extra columns invalid)."""
    B, _, S = scores.shape
    slots = torch.arange(S, device=scores.device)
    pos = positions.view(B, 1, 1)
    scores = scores.float().masked_fill(forced_slots(opts, positions, S), float("inf"))
    scores = scores.masked_fill(slots > pos, float("-inf"))
    n_forced = (scores == float("inf")).sum(-1).amax(-1)  # [B]
    budget = torch.maximum(opts.tokens_on_device(positions + 1), n_forced)  # [B]
    if host is None or forced is None:
        width = int(budget.max())
    else:
        width = min(S, max(max(opts.tokens(p + 1), f) for p, f in zip(host, forced)))
    idx = torch.topk(_tie_broken(scores), width, dim=-1).indices  # [B, Hkv, K]
    in_budget = torch.arange(idx.shape[-1], device=scores.device) < budget.view(B, 1, 1)
    return idx, in_budget & (scores.gather(-1, idx) > float("-inf"))


def _tie_broken(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores [..., S] -> int64 keys in the same order with ties (Quest pages, integer scores) going to the
    lower slot: a total order, so the top K are the same slots whatever K is, and a row selects the same slots
    alone as in any batch."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes 0.0, a tie as in a sort
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).long()  # IEEE order as integers
    return (ordered << 32) | torch.arange(scores.shape[-1] - 1, -1, -1, device=scores.device)


def selection_mask(idx: torch.Tensor, valid: torch.Tensor, kv_len: int) -> torch.Tensor:
    """A selection (idx / valid [..., K]) -> bool [..., kv_len]: the slots it attends to. Invalid columns select
    nothing, whatever slot they hold (a selection may repeat one there)."""
    spill = torch.zeros(*idx.shape[:-1], kv_len + 1, dtype=torch.bool, device=idx.device)  # the last takes invalid
    return spill.scatter(-1, torch.where(valid, idx, kv_len), True)[..., :kv_len]


def device_ints(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Python ints (a list, or nested lists of one width) -> a tensor on `device`; to a GPU through pinned memory,
    without waiting for it (`torch.tensor(values, device="cuda")` synchronises the stream: the GPU drains first)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)


def attend_selected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """Exact attention over the gathered slots. q [B, Hq, T, D], k/v [B, Hkv, S, D], idx [B, Hkv, K], valid
    [B, Hkv, K] (every query alike) or [B, Hkv, T, K] (per query) -> [B, Hq, T, D]."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    gather = idx.unsqueeze(-1).expand(-1, -1, -1, D)
    ks, vs = k.gather(2, gather)[:, :, None], v.gather(2, gather)[:, :, None]  # [B, Hkv, 1, K, D]
    qg = q.view(B, Hkv, Hq // Hkv, T, D)  # [B, Hkv, G, T, D]
    # [B, Hkv, G, T, K], fp32 like SDPA's accumulation
    logits = (qg.float() @ ks.float().transpose(-1, -2)) * D**-0.5
    seen = valid[:, :, None, None] if valid.dim() == 3 else valid[:, :, None]  # [B, Hkv, 1, 1 or T, K]
    probs = logits.masked_fill(~seen, float("-inf")).softmax(-1)
    return (probs.to(vs.dtype) @ vs).view(B, Hq, T, D)


def group_max(per_head: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, Hq, S] -> [B, Hkv, S]: the max over each KV head's query group."""
    B, Hq, S = per_head.shape
    return per_head.view(B, num_kv_heads, Hq // num_kv_heads, S).amax(2)
