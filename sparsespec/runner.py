"""The decode runner: the static KV cache, the captured decode graph and the sparse policy's lifecycle in one place.

    runner = Runner(model, batch, capacity, policy)
    hidden = runner.prefill(prompts)          # dense chunked prefill -> policy.build for every layer
    logits = runner.decode(tokens)            # one token per row at its length; graph replay on CUDA
    runner.truncate(lengths)                  # rollback: the cache and the policy's index both follow
    hidden = runner.prefill_row(row, chunk, start)  # continuous batching: one row's prompt chunk, others kept
    logits = runner.decode_rows(tokens)       # a step of the first len(tokens) rows, the others kept
    logits, feats = runner.verify(block, width)  # speculative verify: a dense block per row, lengths kept
    runner.truncate(accepted_lengths)         # commit: the accepted prefix; rejected slots are not advanced over

On CUDA a graphable policy runs fixed-width sparse steps (`Policy.plan_fixed`): the whole step, every sparse layer's
scoring, selection and attention included, is one CUDA graph replay with no host synchronisation. Other policies
step eagerly. Dense decoding replays the dense graph as before. With the policy's `select_every` N > 1, a step that
selects is followed by up to N - 1 steps that reuse every layer's selection (a second graph, no scoring or
selection); any rollback (`truncate`) makes the next step select again.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention.policy import Policy, device_ints
from .cache import KVCache
from .errors import SparseSpecError
from .graphs import CudaGraphDecodeStep, CudaGraphStep
from .models.transformer import Transformer


_NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def bucket_capacity(capacity: int, limit: int) -> int:
    """The cache size for `capacity` positions when a dense run's steps are compiled or its runner pooled: the next
    of 256, 384, 512, 768, 1024, ... (2^k and 1.5 · 2^k: at most 50% more slots), but not past `limit` (the model's
    context; a capacity beyond it is kept). A compiled step is specialised to its cache's size, and Inductor takes
    tens of seconds for a model's step: with a cache sized to each call's prompt, every call compiled its decode and
    verify steps again (about 40 s a prompt for the 1.5B on the H200); a pooled runner serves the calls of its size.
    Dense steps read only each row's live slots, so the spare slots cost memory, not time."""
    if capacity >= limit:
        return capacity
    size = 256
    while size < capacity:
        size = size * 3 // 2 if size & (size - 1) == 0 else size // 3 * 4  # 2^k -> 1.5 · 2^k -> 2^(k+1)
    return min(size, limit)


def loop_capacity(need: int, limit: int, compile: bool, pooled: bool, sparse: bool = False) -> int:
    """A decoding loop's cache size for `need` slots: `bucket_capacity` where its dense steps are shared with other
    calls (compiled, or taken from a `RunnerPool`), else exactly `need` (a sparse policy's fixed widths are sized to
    the call). Plain decoding, speculation and the bench's replay of both size their caches here alike."""
    return bucket_capacity(need, limit) if not sparse and (compile or pooled) else need


class RunnerPool:
    """Dense runners kept for reuse by the calls of one loop (a benchmark over many prompts): a captured step, and
    with `compile` its compilation, belongs to its runner's static cache, so a call of the same model, batch,
    capacity, taps and graph settings takes the kept runner with its graphs (emptied) instead of capturing and
    compiling again (seconds a call for the 1.5B on the H200, more than its decoding). Kept runners hold their
    caches' memory: a pool lives as long as its loop. Sparse policies are not pooled (their index is per call)."""

    def __init__(self):
        self.runners: dict[tuple, Runner] = {}

    def get(self, model: Transformer, batch: int, capacity: int, cuda_graph: bool = True, compile: bool = False,
            taps: tuple[int, ...] = ()) -> "Runner":
        """An empty dense runner of these settings: the kept one, else a new one (kept for the next call)."""
        key = (id(model), batch, capacity, cuda_graph, compile, tuple(taps))
        runner = self.runners.get(key)
        if runner is None or runner.model is not model:
            runner = self.runners[key] = Runner(model, batch, capacity, None, cuda_graph, compile, taps=taps)
        runner.truncate([0] * batch)  # a prefill writes its prompts from slot 0: what lies past them is dead
        return runner


class Runner:
    def __init__(self, model: Transformer, batch: int, capacity: int, policy: Policy | None = None,
                 cuda_graph: bool = True, compile: bool = False, fixed: bool | None = None,
                 taps: tuple[int, ...] = (), row_graphs: bool = True):
        """`fixed`: step a graphable policy in fixed-width mode (default: on CUDA; on CPU the kernels' torch
        references run, which tests use to check the path). `taps`: decoder layers whose outputs `prefill_tapped`
        and `verify` also return (a speculative drafter's context features). `row_graphs`: graphed dense
        `decode_rows` of a few busy rows replays the graph of a row prefix (faster under light load; a row's
        rounding then depends on how many rows are busy), else always the whole batch's."""
        weight = model.embed_tokens.weight
        self.model = model
        self.cache = KVCache(model.cfg, batch, capacity, weight.dtype, weight.device)
        self.device = weight.device
        self.cuda_graph, self.compile, self.prefer_fixed = cuda_graph, compile, fixed
        self.taps = tuple(taps)
        self.use_row_graphs = row_graphs
        self.graph: CudaGraphDecodeStep | None = None
        self.reuse_graph: CudaGraphDecodeStep | None = None  # select_every > 1: the step over the kept selections
        self.since_select: int | None = None  # steps since the last selecting step; None: the next one selects
        self.row_graphs: dict[int, CudaGraphDecodeStep] = {}  # dense decode of the first n rows (n < batch)
        self.verify_graphs: dict[tuple[int, bool], CudaGraphStep] = {}  # by (width, tree): dense multi-token steps
        self.sparse_graphs: dict[tuple[int, bool], CudaGraphStep] = {}  # by (width, reuse): `sparse_verify`'s
        self.fp8 = False  # decode steps multiply with FP8 copies of the weights (`fp8_decode`)
        self._set(policy)

    def _set(self, policy: Policy | None) -> None:
        self.policy = policy
        cuda = self.device.type == "cuda"
        self.select_every = 1 if policy is None else policy.options.select_every
        if self.select_every > 1 and not (policy.graphable and self.prefer_fixed is not False):
            raise SparseSpecError(f"select_every needs the fixed-width steps of a graphable policy "
                                  f"({policy.name} {'steps eagerly' if not policy.graphable else 'is not fixed here'})")
        self.fixed = policy is not None and policy.graphable and (
            (cuda or self.select_every > 1) if self.prefer_fixed is None else self.prefer_fixed)
        self.graphed = self.cuda_graph and cuda and (policy is None or self.fixed)
        self.graph = self.reuse_graph = None  # a graph holds its policy's buffers: captured again for another one
        self.sparse_graphs = {}
        self.since_select = None
        self.sparse_layers = 0 if policy is None else policy.sparse_layers(self.model.cfg.num_layers)

    def fp8_decode(self) -> None:
        """From now on the decode steps multiply with FP8 copies of the weights (`Transformer.fp8_drafts`): for a
        runner whose decode steps only draft (self-speculation, where the dense verify decides every token and
        keeps the model's weights). The decode graphs are captured again."""
        self.model.fp8_drafts()
        self.fp8 = True
        self.graph = self.reuse_graph = None
        self.sparse_graphs = {}

    def _drafting(self):
        return self.model.drafting() if self.fp8 else nullcontext()

    def use(self, policy: Policy | None) -> None:
        """Decode from the committed tokens on with `policy` (its index built now); e.g. every policy of an
        evaluation after one shared prefill (truncate to the prompt lengths first)."""
        if self.policy is not None:
            self.policy.end_fixed()
        self._set(policy)
        self.build()

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], chunk: int = 1024, progress: bool = False) -> torch.Tensor:
        """Prompts (one per row) -> the last prompt token's hidden state per row [B, H]; the policy indexes them."""
        return self.prefill_tapped(prompts, chunk, progress)[0]

    @torch.inference_mode()
    def prefill_tapped(self, prompts: list[list[int]], chunk: int = 1024, progress: bool = False):
        """As `prefill`, also returning the runner's tapped layers at every prompt position: (hidden [B, H],
        features [B, T, len(taps) * H] or None without taps)."""
        from .generate import prefill_tapped

        hidden, features = prefill_tapped(self.model, self.cache, prompts, chunk, self.taps, progress)
        self.build()
        return hidden, features

    @torch.inference_mode()
    def prefill_row(self, row: int, tokens: list[int], start: int) -> torch.Tensor:
        """Continuous batching: write `tokens`, the chunk of a prompt from position `start` on, into row `row` (whose
        first `start` slots hold the prompt's earlier chunks), attending as `prefill` does, while the other rows
        keep their cache and lengths; the row's length becomes `start + len(tokens)`. -> the chunk's last hidden
        state [H]. Dense attention (a prefill); with a policy, `index_row` once the prompt is in."""
        return self.prefill_row_tapped(row, tokens, start)[0]

    @torch.inference_mode()
    def prefill_row_tapped(self, row: int, tokens: list[int], start: int):
        """As `prefill_row`, also returning the runner's tapped layers at the chunk's positions: (hidden [H],
        features [len(tokens), len(taps) * H] or None without taps)."""
        end = start + len(tokens)
        if not 0 <= start < end <= self.cache.capacity:
            raise ValueError(f"invalid chunk [{start}, {end}) for capacity {self.cache.capacity}")
        positions = torch.arange(start, end, device=self.device)[None]
        hidden, features = self.model.forward_tapped(torch.tensor([tokens], device=self.device), positions,
                                                     self.cache.rows(row, row + 1), end, self.taps)
        lengths = list(self.cache.lengths)
        lengths[row] = end
        self.cache.truncate(lengths)
        return hidden[0, -1], None if features is None else features[0]

    def index_row(self, row: int) -> None:
        """Continuous batching with a policy: build row `row`'s index from its committed slots (its prompt), the
        other rows' kept. The batch's index must exist: `build` it first (e.g. of the empty batch, before the
        first request)."""
        if self.policy is not None:
            self.policy.build_row(self.cache, row, self.cache.lengths[row])

    def build(self) -> None:
        """(Re)build the policy's index from the cache's committed tokens, in fixed-width mode where it can."""
        policy = self.policy
        if policy is None:
            return
        policy.end_fixed()
        policy.reset_attended()
        policy.build_all(self.cache, self.cache.lengths)
        if self.fixed:
            policy.plan_fixed(self.cache, self.cache.lengths)
            self.graph = self.reuse_graph = None  # the plan's buffers are new: capture again
            self.sparse_graphs = {}
        self.since_select = None

    @torch.inference_mode()
    def capture(self, rows: bool = False) -> None:
        """Capture the decode step as a CUDA graph now (else at the first graphed `decode`); once per runner and
        policy build (batch size and capacity are fixed). `rows`: dense decoding also captures the steps of the
        first 1, 2, 4, ... rows, which `decode_rows` replays for a short prefix of busy rows (continuous batching
        under light load then reads the cache of those rows only)."""
        if self.graphed and self.graph is None:
            with self._drafting():
                self.graph = CudaGraphDecodeStep(self.model, self.cache, self.compile, policy=self.policy)
                if self.select_every > 1:  # the reusing step too (its warm-up steps change the kept selections)
                    with self._stepping_as(reuse=True):
                        self.reuse_graph = CudaGraphDecodeStep(self.model, self.cache, self.compile,
                                                               policy=self.policy)
            self.truncate(self.cache.lengths)  # warm-up steps ran at the last slots: put the index back
            if self.policy is not None:
                self.policy.reset_attended()
        if rows and self.use_row_graphs and self.graphed and self.policy is None:
            n = 1
            while n < self.cache.batch:
                self._row_graph(n)
                n *= 2

    def _row_graph(self, n: int) -> CudaGraphDecodeStep:
        """The dense decode graph of rows [0, n) (a view of their cache slots), captured once."""
        if n not in self.row_graphs:
            self.row_graphs[n] = CudaGraphDecodeStep(self.model, self.cache.rows(0, n), self.compile)
        return self.row_graphs[n]

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] -> next-token logits [B, V] fp32; each row's token is appended at its length."""
        cache, policy = self.cache, self.policy
        positions = device_ints(cache.lengths, self.device)  # [B]
        if self.graphed:
            self.capture()
        reuse = self.since_select is not None and self.since_select + 1 < self.select_every
        self.since_select = self.since_select + 1 if reuse else 0
        if self.graphed:
            logits = (self.reuse_graph if reuse else self.graph)(tokens, positions)
        else:
            # an eager policy is told the step's positions so it reads none back from the device
            with self._eager_attention(), self._drafting(), self._stepping_as(reuse=reuse), \
                    policy.stepping(cache.lengths) if policy is not None and policy.fixed is None else nullcontext():
                hidden = self.model(tokens[:, None], positions[:, None], cache, kv_len=max(cache.lengths) + 1,
                                    policy=policy)
                logits = self.model.logits(hidden[:, -1])
        cache.truncate([n + 1 for n in cache.lengths])
        if policy is not None:
            if policy.fixed is not None:
                policy.stepped(self.sparse_layers)
            else:
                policy.append_all(cache, cache.lengths)
        return logits

    @torch.inference_mode()
    def decode_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Continuous batching: a decode step of the first `len(tokens)` rows only (the others keep their cache and
        lengths); -> their next-token logits. Eager dense steps compute just those rows; graphed dense steps replay
        the graph of the first 1, 2, 4, ... rows that covers them; a step with a policy (whose index holds every
        row) runs the whole batch. Rows computed beyond the first `len(tokens)` get token 0 and their lengths
        rolled back."""
        n, B = len(tokens), self.cache.batch
        if not 0 < n <= B:
            raise ValueError(f"decode_rows of {n} rows in a batch of {B}")
        lengths = list(self.cache.lengths)
        m = min(1 << (n - 1).bit_length(), B)  # a graph of rows [0, m): [n, m) ride along
        if self.graphed and self.policy is None and self.use_row_graphs and m < B:
            logits = self._row_graph(m)(torch.cat([tokens, tokens.new_zeros(m - n)]),
                                        device_ints(lengths[:m], self.device))[:n]
        elif self.graphed or self.policy is not None:
            logits = self.decode(torch.cat([tokens, tokens.new_zeros(B - n)]))[:n]
        else:
            positions = device_ints(lengths[:n], self.device)
            with self._eager_attention():
                hidden = self.model(tokens[:, None], positions[:, None], self.cache.rows(0, n),
                                    kv_len=max(lengths[:n]) + 1)
            logits = self.model.logits(hidden[:, -1])
        self.truncate([x + 1 for x in lengths[:n]] + lengths[n:])
        return logits

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, observer: Callable | None = None) -> torch.Tensor:
        """tokens [B, W] written at each row's length (dense attention, eager) -> hidden [B, W, H]. Lengths do not
        move: commit with `truncate` (e.g. a drafter catching up on tokens another model committed).
        `observer(layer, q, k)` sees each layer's post-RoPE q and k (measurements of teacher-forced steps)."""
        return self._eager(tokens, (), observer)[0]

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, width: int | None = None,
               tree: tuple[torch.Tensor, torch.Tensor] | None = None):
        """A speculative verify step: tokens [B, w] at each row's length, dense attention -> (logits [B, w, V] fp32,
        features [B, w, len(taps) * H] or None). Lengths do not move: the caller commits the accepted prefix with
        `truncate` (a rejected draft's slots are simply not advanced over). With `width` >= w on CUDA the step
        replays a graph of that width (captured once, blocks padded), where every row has room for it. `tree`:
        (depth, ancestor bits) [B, w] of a tree block (`spec.tree`; its nodes at consecutive slots, each seeing the
        context and its ancestors)."""
        B, w = tokens.shape
        if width is not None and self.capture_verify(width, tree is not None):
            if w < width:  # (a full block goes in as it is: no padding kernels)
                pad = tokens.new_zeros(B, width - w)
                tokens = torch.cat([tokens, pad], 1)
                tree = None if tree is None else (torch.cat([tree[0], pad], 1), torch.cat([tree[1], pad], 1))
            logits, features = self.verify_graphs[width, tree is not None](tokens, self._positions(width), tree)
            return logits[:, :w], None if features is None else features[:, :w]
        hidden, features = self._eager(tokens, self.taps, tree=tree)
        return self.model.logits(hidden), features

    @torch.inference_mode()
    def capture_verify(self, width: int, tree: bool = False) -> bool:
        """Capture the verify step of `width` tokens (a tree step with `tree`) as a CUDA graph now (else at its
        first `verify`), where graphs run and every row has room for it -> whether `verify(..., width)` replays a
        graph."""
        return self._capture(self.verify_graphs, (width, tree), width, self.cuda_graph and self.device.type == "cuda",
                             lambda: CudaGraphStep(self.model, self.cache, width, self.taps, self.compile, tree=tree))

    def _capture(self, graphs: dict, key, width: int, able: bool, make: Callable[[], CudaGraphStep]) -> bool:
        """`graphs[key]`, a step of `width` tokens, made by `make` once, where `able` (graphs run) and every row has
        room for it -> whether that graph replays."""
        if not (able and max(self.cache.lengths) + width <= self.cache.capacity):
            return False
        if key not in graphs:
            graphs[key] = make()
            self.truncate(self.cache.lengths)  # warm-up steps ran at the last slots: put the index back
        return True

    @torch.inference_mode()
    def sparse_verify(self, tokens: torch.Tensor, width: int | None = None, reuse: list[bool] | None = None):
        """A block under the runner's policy (the sparse level of a cascade, `spec.cascade`): tokens [B, w] at each
        row's length -> (logits [B, w, V] fp32, features [B, w, len(taps) * H] or None). In each sparse layer the
        block's first query selects as a decode step there would, and every query attends to that selection and
        the block up to itself (`SelectionPolicy.block`), as that many decode steps reusing the selection would;
        the dense layers attend densely. `reuse[r]` (select_every = N > 1): row r selects nothing, it attends to
        each sparse layer's kept selection from its last selecting block and the slots after it (its block within
        N − 1 slots of that one: the caller's rule); a block where every row reuses selects nothing at all.
        Lengths do not move: commit with `truncate`. With `width` >= w
        on CUDA a graph of that width replays (blocks padded), where the policy steps in fixed width and every row
        has room for it. FP8 draft weights (`fp8_decode`) multiply here too: its tokens only propose."""
        policy = self.policy
        if policy is None or not policy.blocks:
            name = "none" if policy is None else policy.name
            raise SparseSpecError(f"a sparse verify needs a policy that selects keys for a block of queries "
                                  f"(binarypc, topk, quest, streaming, ...), not {name}")
        B, w = tokens.shape
        reuse = [False] * B if reuse is None else list(reuse)
        if any(reuse) and self.select_every == 1:
            raise SparseSpecError("a sparse verify reuses kept selections with select_every > 1 only")
        if self.select_every > 1 and policy.fixed is not None:  # (the rows that keep theirs in a selecting block)
            policy.fixed.keep.copy_(device_ints(reuse, self.device, torch.bool))
        self.since_select = None  # the kept selections are a block's now: the next decode step selects
        reuse = all(reuse)  # every row reuses: a block that selects nothing
        if width is not None and self.capture_sparse(width, reuse):
            if w < width:
                tokens = torch.cat([tokens, tokens.new_zeros(B, width - w)], 1)
            logits, features = self.sparse_graphs[width, reuse](tokens, self._positions(width))
            policy.stepped(self.sparse_layers)
            return logits[:, :w], None if features is None else features[:, :w]
        kv_len = max(self.cache.lengths) + w
        with self._eager_attention(), self._drafting(), self._stepping_as(True, reuse), \
                policy.stepping(self.cache.lengths) if policy.fixed is None else nullcontext():
            hidden, features = self.model.forward_tapped(tokens, self._positions(w), self.cache, kv_len, self.taps,
                                                         policy)
        if policy.fixed is not None:
            policy.stepped(self.sparse_layers)
        return self.model.logits(hidden), features

    @torch.inference_mode()
    def capture_sparse(self, width: int, reuse: bool = False) -> bool:
        """Capture `sparse_verify`'s step of `width` tokens (reusing kept selections with `reuse`) as a CUDA graph now
        (else at its first call), where graphs run with the policy in fixed width and every row has room -> whether
        `sparse_verify(..., width, reuse)` replays."""
        def make() -> CudaGraphStep:
            with self._drafting(), self._stepping_as(True, reuse):
                step = CudaGraphStep(self.model, self.cache, width, self.taps, self.compile, policy=self.policy)
            self.policy.reset_attended()  # (the warm-up steps' keys)
            return step

        return self._capture(self.sparse_graphs, (width, reuse), width, self.graphed and self.policy is not None,
                             make)

    def _positions(self, width: int) -> torch.Tensor:
        """[B, width]: the next `width` positions of every row, from its length on."""
        return device_ints(self.cache.lengths, self.device)[:, None] + torch.arange(width, device=self.device)

    def _eager(self, tokens: torch.Tensor, taps: tuple[int, ...], observer: Callable | None = None,
               tree: tuple[torch.Tensor, torch.Tensor] | None = None):
        """tokens [B, W] at each row's length, dense attention, eager -> (hidden [B, W, H], features or None)."""
        kv_len = max(self.cache.lengths) + tokens.shape[1]  # on the host: no read-back
        with self._eager_attention():
            return self.model.forward_tapped(tokens, self._positions(tokens.shape[1]), self.cache, kv_len, taps,
                                             observer=observer, tree=tree)

    @contextmanager
    def _stepping_as(self, block: bool = False, reuse: bool = False):
        """Within: fixed-width steps run (or are captured) as block passes with `block` (`SelectionPolicy.block`,
        one token too) and reusing the kept selections with `reuse` (no plan: nothing changes)."""
        plan = None if self.policy is None else self.policy.fixed
        if plan is None:
            yield
            return
        plan.block, plan.reusing = block, reuse
        try:
            yield
        finally:
            plan.block = plan.reusing = False

    def _eager_attention(self):
        """Eager CUDA steps keep cuDNN out of dense attention (it plans anew for every key count, ~40 ms a step)."""
        return sdpa_kernel(_NOT_CUDNN) if self.device.type == "cuda" else nullcontext()

    def truncate(self, lengths: list[int]) -> None:
        """Roll rows back (or forward after a multi-token commit) to `lengths`; the policy's index follows."""
        self.cache.truncate(lengths)
        self.since_select = None  # kept selections may hold slots past the new lengths: select again
        if self.policy is not None:
            self.policy.append_all(self.cache, self.cache.lengths)
