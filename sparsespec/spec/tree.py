"""Tree verification of a DFlash block: the drafter's per-position choices spent as a tree, verified in one step.

A DFlash drafter predicts each position of its block from the context and MASK slots, not from the drafts before
it: per position it gives a distribution (its marginals). The linear verify checks one path, the argmax at every
position. A tree of the same number of nodes spends them where the marginals are unsure (a second choice at an early
position before an unlikely last one); the target verifies every node in one forward (each node sees the context and
its ancestors, at the position of its depth), and the deepest node whose whole path equals the target's tokens
(its argmax, or at T > 0 its draws: `decode.tree_step`) is committed, then the target's token after it: lossless
(`bench/tree_accept.py` measured τ 4.18 -> 4.92 at 15 drafted nodes for the 1.5B's shipped drafter on HumanEval,
CPU; the H200 4.55 against the line's 3.90 over 153 problems).

    pool     every path of ranks (r_1, .., r_d), d <= W, whose ranks sum to at most `most`; parents first
    choose   ids, logp [B, W, R] (the drafter's top-R choices per position) -> the n pool paths of highest
             Σ logp (a child never outscores its parent, so the chosen paths form a tree): its node tokens, depths,
             parents and ancestor bit masks, block index 0 the root (the pending token), nodes 1..n after it in
             pool order (parents first)
    accept   the tree and the target's token (argmax or draw) after every block index -> per row the deepest
             node whose path the target agrees with (every row at once, on the device)

Everything is a fixed-shape tensor computation (one top-k, gathers): `TreeVerify` runs it around the target's
verify step, eagerly or as two CUDA graphs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..graphs import Kept, capture
from ..runner import Runner

MAX_NODES = 62  # drafted nodes of a tree: with the root, one bit each of an int64 ancestor mask
_UNUSABLE = -1e9  # the score of a path deeper than its row's limit (log-probabilities sum to well above it)


def pool_paths(width: int, most: int = 2) -> list[tuple[int, ...]]:
    """Every path of ranks of 1..width depths whose ranks sum to at most `most`, breadth first (parents first)."""
    paths, frontier = [], [()]
    while frontier:
        frontier = [p + (r,) for p in frontier if len(p) < width for r in range(most + 1) if sum(p) + r <= most]
        paths += frontier
    return paths


@dataclass(frozen=True)
class Pool:
    """A pool of candidate paths as tensors: ranks [P, W] (the path's rank at each depth, −1 past its end), depth [P],
    ancestors [P, W] (the pool index of the path's prefix of each depth, −1 past its end; the last is the path);
    ranks_needed: the drafter's choices per position the pool reads (its highest rank + 1; kept on the host, so that
    a step on the GPU never reads it back)."""
    ranks: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor
    ranks_needed: int

    @classmethod
    def of(cls, width: int, most: int = 2, device=None) -> "Pool":
        paths = pool_paths(width, most)
        index = {p: i for i, p in enumerate(paths)}
        ranks = torch.full((len(paths), width), -1, dtype=torch.long)
        ancestors = torch.full((len(paths), width), -1, dtype=torch.long)
        for i, p in enumerate(paths):
            ranks[i, :len(p)] = torch.tensor(p)
            ancestors[i, :len(p)] = torch.tensor([index[p[:d + 1]] for d in range(len(p))])
        depth = (ranks >= 0).sum(1)
        return cls(ranks.to(device), depth.to(device), ancestors.to(device), int(ranks.max()) + 1)

    @property
    def width(self) -> int:
        return self.ranks.shape[1]


@dataclass
class Tree:
    """A batch of trees, block index 0 the root (the pending token), 1..n the drafted nodes (parents first).
    tokens [B, n] (node i's token at column i − 1), depth [B, n + 1] (the root 0), parent [B, n + 1] (the root's own
    index 0), ancestors [B, n + 1] int64 (bit j set: block index j is the node or one of its ancestors), usable
    [B, n + 1] bool (False: a node past its row's depth limit, verified but never accepted)."""
    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    ancestors: torch.Tensor
    usable: torch.Tensor


def choose(pool: Pool, ids: torch.Tensor, logp: torch.Tensor, n: int, limit: torch.Tensor | None = None) -> Tree:
    """ids, logp [B, W, R] (R >= pool.ranks_needed: the drafter's choices per position, best first, and their
    log-probabilities) -> the tree of the n pool paths of highest total log-probability, each path's score lowered by
    a hair per depth so that a child never ties its parent (the chosen set is then always prefix-closed).
    limit [B] (or None: W): the deepest a row's accepted path may go (a row near its end drafts fewer tokens);
    deeper paths score below every other and, chosen to fill a small tree's n nodes, are marked not usable."""
    B, W, R = ids.shape
    if not 1 <= n <= min(MAX_NODES, pool.ranks.shape[0]) or W < pool.width or R < pool.ranks_needed:
        raise ValueError(f"a tree of {n} nodes from a pool of {pool.ranks.shape[0]} paths over {pool.width} "
                         f"positions and {pool.ranks_needed} choices, given {W} positions and {R} choices")
    depths = torch.arange(pool.width, device=ids.device)
    live = pool.ranks >= 0  # [P, W]
    # [B, P, W]: the log-probability of each path's choice at each depth (<= 0: a path never outscores its prefix)
    step = logp[:, depths, pool.ranks.clamp(min=0)].clamp(max=0)
    score = torch.where(live, step, 0.0).sum(-1) - 1e-4 * pool.depth  # [B, P]
    if limit is not None:
        score = torch.where(pool.depth <= limit[:, None], score, _UNUSABLE)
    chosen = score.topk(n, dim=1).indices.sort(dim=1).values  # [B, n] pool indices, parents first
    depth = pool.depth[chosen]  # [B, n]
    rank = pool.ranks[chosen, depth - 1]  # [B, n]: each node's choice at its own depth
    tokens = ids[torch.arange(B, device=ids.device)[:, None], depth - 1, rank]  # [B, n]
    block = torch.zeros(B, pool.ranks.shape[0], dtype=torch.long, device=ids.device)  # pool index -> block index
    block.scatter_(1, chosen, torch.arange(1, n + 1, device=ids.device).expand(B, -1))
    anc = pool.ancestors[chosen]  # [B, n, W] pool indices of each node's prefixes
    anc_block = block.gather(1, anc.clamp(min=0).flatten(1)).view(B, n, -1)  # [B, n, W]
    bits = torch.where(anc >= 0, torch.ones_like(anc_block) << anc_block, 0).sum(-1) | 1  # [B, n]: and the root
    parent_pool = torch.where(depth > 1, anc.gather(2, (depth - 2).clamp(min=0)[..., None])[..., 0], -1)
    parent = torch.where(parent_pool >= 0, block.gather(1, parent_pool.clamp(min=0)), 0)  # [B, n]
    zero = torch.zeros(B, 1, dtype=torch.long, device=ids.device)
    usable = torch.ones(B, n + 1, dtype=torch.bool, device=ids.device)
    if limit is not None:
        usable[:, 1:] = depth <= limit[:, None]
    return Tree(tokens, torch.cat([zero, depth], 1), torch.cat([zero, parent], 1), torch.cat([zero + 1, bits], 1),
                usable)


def accept(tree: Tree, best: torch.Tensor) -> torch.Tensor:
    """best [B, n + 1]: the target's token after each block index -> [B] the block index of each row's deepest node
    whose path the target agrees with (0: none, the root)."""
    B, width = best.shape
    agree = torch.ones(B, width, dtype=torch.bool, device=best.device)
    agree[:, 1:] = (tree.tokens == best.gather(1, tree.parent[:, 1:])) & tree.usable[:, 1:]
    agreed = (agree.long() << torch.arange(width, device=best.device)).sum(1)  # [B] bit j: node j agrees
    whole = (tree.ancestors & ~agreed[:, None]) == 0  # [B, n + 1]: every node of the path agrees
    return torch.where(whole, tree.depth, -1).argmax(1)


def path(ancestors: int) -> list[int]:
    """An ancestor bit mask -> the block indices it holds, root first (parents precede children in block order)."""
    return [j for j in range(ancestors.bit_length()) if ancestors >> j & 1]


class TreeVerify:
    """A tree verify of n nodes a row from `pool`: the work on either side of the target's verify step.

        draft   ids, logp [B, W, R] (the drafter's choices), pending [B], limit [B] (each row's deepest path: its
                proposal budget) -> the verify block [B, n + 1] (each row's pending token, then its nodes) and its
                tree (depths, ancestor bits [B, n + 1])
        settle  the target's token after each block index [B, n + 1] (argmax or draw), its features
                [B, n + 1, F] or None, live [B] bool (the rows that decode), starts [B] (each row's pending slot)
                -> (a table [B, 2n + 2] for the host's one read-back: the accepted path's ancestor bits, the
                target's tokens, the node tokens; the features of each row's path first, in order, [B, W + 1, F] or
                None). The path's K/V move in the cache to the slots after the pending token, as a line verify
                would have left them (`KVCache.compact`); rows not live keep theirs.

    Eager, or after `capture` two CUDA graphs over static buffers (about 50 small kernels a step otherwise, each
    launched from Python beside a verify that is one graph replay)."""

    def __init__(self, pool: Pool, n: int):
        self.pool, self.n = pool, n
        self.graphs: tuple[_Graph, _Graph] | None = None  # draft's and settle's, after `capture`
        self.bound = lambda: None  # a weak reference to the cache the graphs move K/V in (kept alive by its runner)
        # id(cache) -> (graphs, a weak reference to the cache): a loop's calls on pooled runners capture once a
        # cache, and the kept graphs keep no dead runner's cache alive (an entry is used only while its cache is)
        self.kept = Kept()
        self._tree: Tree | None = None  # the eager draft's tree, for its settle

    def bind(self, runner: Runner) -> None:
        """Capture both graphs for the runner's cache, where its steps run as graphs (once per cache, kept for later
        calls on it; a loop's set-up calls this, so that the capture is not timed as decoding)."""
        if not (runner.cuda_graph and runner.device.type == "cuda"):  # eager (a kept tree once graphed elsewhere)
            self.graphs, self.bound = None, lambda: None
        elif self.bound() is not runner.cache:
            width = runner.model.cfg.hidden_size * len(runner.taps)
            self.capture(runner.cache, (width, runner.model.embed_tokens.weight.dtype) if runner.taps else None)

    def capture(self, cache: KVCache, features: tuple[int, torch.dtype] | None) -> None:
        """The graphs for `cache`'s batch (`features`: the verify's feature width and dtype, or None): the ones kept
        for this cache, else captured now."""
        self.graphs, self.bound = None, lambda: None
        self.graphs, self.bound = self.kept.get(id(cache), lambda: (self._capture(cache, features),
                                                                     weakref.ref(cache)),
                                                valid=lambda kept: kept[1]() is cache)

    def _capture(self, cache: KVCache, features: tuple[int, torch.dtype] | None) -> tuple[_Graph, _Graph]:
        """Warm-up and capture run on zero inputs: no row live, so no K/V moves."""
        B, W, R, n, dev = cache.batch, self.pool.width, self.pool.ranks_needed, self.n, cache.device
        ids, logp = torch.zeros(B, W, R, dtype=torch.long, device=dev), torch.zeros(B, W, R, device=dev)
        pending, best = torch.zeros(B, dtype=torch.long, device=dev), torch.zeros(B, n + 1, dtype=torch.long,
                                                                                     device=dev)
        feats = None if features is None else torch.zeros(B, n + 1, features[0], dtype=features[1], device=dev)
        live, starts = torch.zeros(B, dtype=torch.bool, device=dev), torch.zeros(B, dtype=torch.long, device=dev)
        cache.addresses()  # (an upload: before any capture)
        limit = torch.zeros(B, dtype=torch.long, device=dev)
        pool = self.pool
        graph, (tree, block) = capture(lambda: _draft(pool, n, ids, logp, pending, limit), dev, warmup=1)
        drafted = _Graph(graph, (ids, logp, pending, limit), (block, (tree.depth, tree.ancestors)))
        graph, settled = capture(lambda: _settle(pool, tree, best, feats, live, starts, cache), dev, warmup=1)
        return drafted, _Graph(graph, (best, feats, live, starts), settled)

    def draft(self, ids: torch.Tensor, logp: torch.Tensor, pending: torch.Tensor, limit: torch.Tensor):
        if self.graphs is not None:
            return self.graphs[0](ids, logp, pending, limit)
        self._tree, block = _draft(self.pool, self.n, ids, logp, pending, limit)
        return block, (self._tree.depth, self._tree.ancestors)

    def settle(self, best: torch.Tensor, features: torch.Tensor | None, live: torch.Tensor, starts: torch.Tensor,
               cache: KVCache):
        if self.graphs is not None:
            assert cache is self.bound(), "bind the runner whose cache this is"
            return self.graphs[1](best, features, live, starts)
        assert self._tree is not None, "draft first"
        return _settle(self.pool, self._tree, best, features, live, starts, cache)


@dataclass(frozen=True)
class _Graph:
    """A captured graph, its static inputs (None: an absent input) and its outputs: a call copies its arguments
    in and replays it -> the outputs (overwritten by the next call)."""
    graph: torch.cuda.CUDAGraph
    inputs: tuple
    outputs: tuple

    def __call__(self, *args):
        for static, x in zip(self.inputs, args, strict=True):
            if static is not None:
                static.copy_(x)
        self.graph.replay()
        return self.outputs


def _draft(pool: Pool, n: int, ids, logp, pending, limit) -> tuple[Tree, torch.Tensor]:
    tree = choose(pool, ids, logp, n, limit)
    return tree, torch.cat([pending[:, None], tree.tokens], 1)  # [B, n + 1]


def _settle(pool: Pool, tree: Tree, best, features, live, starts, cache: KVCache):
    n = tree.tokens.shape[1]
    bits = torch.where(live, tree.ancestors.gather(1, accept(tree, best)[:, None])[:, 0], -1)  # [B]; all: no move
    cache.compact(starts, bits, n + 1)
    if features is not None:  # each row's path first, in order: what a line's verify would have given
        j = torch.arange(n + 1, device=bits.device)
        order = torch.where((bits[:, None] >> j & 1) != 0, j, j + n + 1).argsort(1)[:, :pool.width + 1]
        features = features.gather(1, order[..., None].expand(-1, -1, features.shape[-1]))  # [B, W + 1, F]
    return torch.cat([bits[:, None], best, tree.tokens], 1), features  # [B, 2n + 2]
