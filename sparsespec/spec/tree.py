"""Tree verification of a DFlash block: the drafter's per-position choices spent as a tree, verified in one step.

A DFlash drafter predicts each position of its block from the context and MASK slots, not from the drafts before
it: per position it gives a distribution (its marginals). The linear verify checks one path, the argmax at every
position. A tree of the same number of nodes spends them where the marginals are unsure (a second choice at an early
position before an unlikely last one); the target verifies every node in one forward (each node sees the context and
its ancestors, at the position of its depth), and the deepest node whose whole path equals the target's greedy
tokens is committed, then the target's token after it: lossless at T = 0 (`bench/tree_accept.py` measured τ 4.18 ->
4.92 at 15 drafted nodes for the 1.5B's shipped drafter on HumanEval, CPU).

    pool     every path of ranks (r_1, .., r_d), d <= W, whose ranks sum to at most `most`; parents first
    choose   ids, logp [B, W, R] (the drafter's top-R choices per position) -> the n pool paths of highest
             Σ logp (a child never outscores its parent, so the chosen paths form a tree): its node tokens, depths,
             parents and ancestor bit masks, block index 0 the root (the pending token), nodes 1..n after it in
             pool order (parents first)
    accept   the tree and the target's argmax at every block index -> per row the deepest node whose path the
             target agrees with (every row at once, on the device)

Everything is a fixed-shape tensor computation (one top-k, gathers): capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_NODES = 62  # drafted nodes of a tree: with the root, one bit each of an int64 ancestor mask


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
    index 0), ancestors [B, n + 1] int64 (bit j set: block index j is the node or one of its ancestors)."""
    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    ancestors: torch.Tensor


def choose(pool: Pool, ids: torch.Tensor, logp: torch.Tensor, n: int) -> Tree:
    """ids, logp [B, W, R] (R >= pool.ranks_needed: the drafter's choices per position, best first, and their
    log-probabilities) -> the tree of the n pool paths of highest total log-probability, each path's score lowered by
    a hair per depth so that a child never ties its parent (the chosen set is then always prefix-closed)."""
    B, W, R = ids.shape
    if not 1 <= n <= min(MAX_NODES, pool.ranks.shape[0]) or W < pool.width or R < pool.ranks_needed:
        raise ValueError(f"a tree of {n} nodes from a pool of {pool.ranks.shape[0]} paths over {pool.width} "
                         f"positions and {pool.ranks_needed} choices, given {W} positions and {R} choices")
    depths = torch.arange(pool.width, device=ids.device)
    live = pool.ranks >= 0  # [P, W]
    # [B, P, W]: the log-probability of each path's choice at each depth (<= 0: a path never outscores its prefix)
    step = logp[:, depths, pool.ranks.clamp(min=0)].clamp(max=0)
    score = torch.where(live, step, 0.0).sum(-1) - 1e-4 * pool.depth  # [B, P]
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
    return Tree(tokens, torch.cat([zero, depth], 1), torch.cat([zero, parent], 1), torch.cat([zero + 1, bits], 1))


def accept(tree: Tree, best: torch.Tensor) -> torch.Tensor:
    """best [B, n + 1]: the target's argmax after each block index -> [B] the block index of each row's deepest node
    whose path the target agrees with (0: none, the root)."""
    B, width = best.shape
    agree = torch.ones(B, width, dtype=torch.bool, device=best.device)
    agree[:, 1:] = tree.tokens == best.gather(1, tree.parent[:, 1:])
    agreed = (agree.long() << torch.arange(width, device=best.device)).sum(1)  # [B] bit j: node j agrees
    whole = (tree.ancestors & ~agreed[:, None]) == 0  # [B, n + 1]: every node of the path agrees
    return torch.where(whole, tree.depth, -1).argmax(1)


def path(ancestors: int) -> list[int]:
    """An ancestor bit mask -> the block indices it holds, root first (parents precede children in block order)."""
    return [j for j in range(ancestors.bit_length()) if ancestors >> j & 1]
