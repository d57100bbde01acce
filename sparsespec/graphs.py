"""Forward steps captured as CUDA graphs: W tokens per row at per-row positions, attending the whole static cache.

Static shapes make this possible: the cache is preallocated and the causal mask hides slots past each query's
position, so a replay only needs the new tokens and positions copied into the graph's input buffers. Width 1 is the
decode step; width B is a speculative verify step (a block of B positions, shorter blocks padded at the end: the
padding writes K/V past the committed length, which is dead, and later queries never see it before it is rewritten).
"""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from .attention.policy import Policy
from .cache import KVCache
from .models.transformer import Transformer


class CudaGraphStep:
    def __init__(self, model: Transformer, cache: KVCache, width: int = 1, taps: Sequence[int] = (),
                 compile: bool = False, warmup: int = 3, policy: Policy | None = None, tree: bool = False):
        """`tree`: a tree verify step (`Transformer.plan`'s tree: depths and ancestor bits are inputs too).
        `taps`: also return the outputs of these decoder layers (drafter context features). `compile`: run the
        step through torch.compile first, which fuses the small element-wise kernels (norms, rotary, SwiGLU,
        residuals) that otherwise dominate a batch-1 step; costs a compilation per shape. `policy`: the sparse
        decode attention, in its fixed-width mode (`plan_fixed` done), captured with the step."""
        device = cache.device
        self.taps = tuple(taps)
        # a plain function, not a bound method: a graph object must not sit in a reference cycle, or the cyclic
        # GC may free it (and its memory pool) in the middle of a later capture, which invalidates that capture
        # (a sparse policy's calls stay outside the compiled graphs: graph breaks, replayed inside the CUDA graph)
        self.step = (torch.compile(_step, fullgraph=policy is None, dynamic=False,
                                   options=invariant_options(model)) if compile else _step)
        self.tokens = torch.zeros(cache.batch, width, dtype=torch.long, device=device)  # [B, W]
        # Warm-up and capture write at the last W slots of each row: never committed tokens (capacity >= length + W).
        last = torch.arange(cache.capacity - width, cache.capacity, device=device)
        self.positions = last.expand(cache.batch, -1).clone()  # [B, W]
        # a tree step's inputs start as a straight line (depth = index, each node the last one's child)
        line = torch.arange(width, device=device)
        self.tree = (line.expand(cache.batch, -1).clone(),
                     ((torch.ones_like(line) << (line + 1)) - 1).expand(cache.batch, -1).clone()) if tree else None
        args = (model, cache, self.tokens, self.positions, self.taps, policy, self.tree)
        step = self.step
        self.graph, (self.logits, self.features) = capture(lambda: step(*args), device, warmup)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 tree: tuple[torch.Tensor, torch.Tensor] | None = None):
        """tokens, positions [B, W] (and a tree step's depths and ancestor bits [B, W]) -> (logits [B, W, V] fp32,
        features [B, W, taps * hidden] or None); views reused by the next call."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        if self.tree is not None:
            self.tree[0].copy_(tree[0])
            self.tree[1].copy_(tree[1])
        self.graph.replay()
        return self.logits, self.features


def invariant_options(model: Transformer) -> dict[str, bool] | None:
    """Inductor options for a model with row-invariant products: the compiled norms and element-wise kernels must
    round a row alike whatever the step's row count too. Inductor otherwise picks a reduction's block shape by the
    row count and by timing candidate configurations on the device (which differs from one compilation to the
    next); `deterministic` stops the timing, `batch_invariant` (newer torch) fixes the shape. A fused element-wise
    kernel otherwise keeps its intermediates in fp32 where eager rounds each op to bf16, and how Inductor fuses the
    rotary, bias and residual ops differs between a one-token graph and a verify block's graph (measured on the H200:
    the verify logits of the 1.5B's layout differed from the decode step's in the last bits without
    `emulate_precision_casts`, bitwise equal with it)."""
    if not model.invariant_rows:
        return None
    config = torch._inductor.config
    keys = ("deterministic", "batch_invariant", "emulate_precision_casts")
    return {key: True for key in keys if hasattr(config, key)} or None


class Kept:
    """Captured graphs kept for a loop's later calls, keyed by what they were captured for (a cache size, a cache),
    at most `size` of them: the least recently used is dropped (its memory freed) before a new one is made. A
    benchmark's prompts fall in a few cache sizes, and each capture costs a full garbage collection (`capture`) and
    a warm-up, which in a process holding a compiled model takes longer than decoding a short answer."""

    def __init__(self, size: int = 8):
        self.size = size
        self.entries: OrderedDict = OrderedDict()

    def get(self, key, make: Callable[[], object], valid: Callable[[object], bool] = lambda value: True):
        """The entry kept for `key` (where `valid`), else `make()` (kept)."""
        if key in self.entries and valid(self.entries[key]):
            self.entries.move_to_end(key)
            return self.entries[key]
        self.entries.pop(key, None)
        while len(self.entries) >= self.size:
            self.entries.popitem(last=False)
        value = self.entries[key] = make()
        return value

    def clear(self) -> None:
        self.entries.clear()


# Dynamo's recompile limits while a graph is captured (a compiled function's cache entries, for one code object and
# in all). A compiled step is specialised anew by every capture (dynamic=False: another batch, width, cache size or
# model), around a sparse policy's graph breaks once per decoder layer too, and Dynamo keeps every earlier capture's
# entries for the life of the process: a server, a benchmark or a test session that captures many shapes reaches
# its default limits (16 and 256) with no step at fault, and past them a fullgraph step fails and any other falls
# back to eager without a word. A compiled step runs only here (its replays bypass Dynamo), so long guard lists cost
# nothing later: the limits are lifted for the capture alone.
CAPTURE_RECOMPILE_LIMITS = dict(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 18)


def capture(fn: Callable[[], object], device: torch.device, warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `fn` (which reads and writes only static tensors) `warmup` times on a side stream, then capture it
    -> (the graph, fn's outputs: tensors that every replay overwrites). Dynamo's recompile limits are lifted
    meanwhile (`CAPTURE_RECOMPILE_LIMITS`), never lowered."""
    config = torch._dynamo.config
    with config.patch(**{k: max(getattr(config, k), v) for k, v in CAPTURE_RECOMPILE_LIMITS.items()}):
        return _capture(fn, device, warmup)


def _capture(fn: Callable[[], object], device: torch.device, warmup: int) -> tuple[torch.cuda.CUDAGraph, object]:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    gc.collect()  # free dead graphs now, and let no collection run during the capture
    gc.disable()
    try:
        with torch.cuda.graph(graph), torch.inference_mode():
            out = fn()
    finally:
        gc.enable()
    return graph, out


def _step(model: Transformer, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, taps: tuple[int, ...],
          policy: Policy | None, tree: tuple[torch.Tensor, torch.Tensor] | None = None):
    hidden, features = model.forward_tapped(tokens, positions, cache, None, taps, policy, tree=tree)
    return model.logits(hidden), features


class CudaGraphDecodeStep(CudaGraphStep):
    """One decode step: tokens, positions [B] -> next-token logits [B, V]."""

    def __init__(self, model: Transformer, cache: KVCache, compile: bool = False, warmup: int = 3,
                 policy: Policy | None = None):
        super().__init__(model, cache, 1, (), compile, warmup, policy)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return super().__call__(tokens[:, None], positions[:, None])[0][:, -1]
