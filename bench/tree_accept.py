"""What verifying a tree of drafts, not one line, would buy a DFlash drafter: τ on the decoding loop's schedule,
teacher-forced on the target's own greedy answers (real weights; on any device).

A DFlash drafter predicts every position of its block in one pass, each from the context and the block's MASK
slots, not from the drafts before it: what it gives is a distribution per position (its marginals). The shipped
loop verifies one line, the argmax of each. A tree verify of the same width would spend its nodes where the
marginals are unsure (a second choice at position 1 before an unlikely 15th position), and accept the deepest node
whose path equals the target's tokens: lossless, one verify step, a tree attention mask. This script measures the
acceptance side of that trade, not its cost:

    linear        the shipped verify: the argmax at each of the block's B − 1 positions (B nodes with the root)
    top-c         c choices at position 1, each followed by the argmax line (c · (B − 1) nodes)
    best-first N  per block, the N most probable paths by the product of the marginals (EAGLE-2's rule;
                  a sequential choice, for reference)
    static N      one tree shape for every block, by rank: best-first on how often the answer's token holds each
                  rank at each depth, counted on the first half of the prompts, measured on the second half
    top-N of S    per block the N most probable paths by the marginals among the nodes of the static tree of S nodes
                  (a child never outscores its parent, so they form a tree: one top-k, capturable in a graph)
    top-N of rank-sum <= 2   the same among every path whose ranks sum to at most 2 (no calibration): what the
                  loop's tree verify does (`--draft treeN:dflash`, `sparsespec.spec.tree`)

    python bench/tree_accept.py --target qwen2.5-coder-1.5b --drafter sparsespec/drafters/qwen2.5-coder-1.5b-dflash \
        --prompts 24 --max-new-tokens 128 [--nodes 15,31,63] [--out DIR]

Prints a table (and writes tree_accept.json / .md under --out). HumanEval prompts by default: evaluation only.
"""

from __future__ import annotations

import argparse
import heapq
import json
import time
from pathlib import Path

import torch

from sparsespec.generate import Engine
from sparsespec.spec.dflash import DFlash
from sparsespec.spec.prompts import make_prompts
from sparsespec.spec.train import block_loss, regenerate
from sparsespec.spec.tree import pool_paths

RANKS = 8  # choices kept per position


@torch.no_grad()
def marginals(drafter: DFlash, engine: Engine, data, chunk: int = 16):
    """Per answer: (ids [A, B − 1, RANKS], log-probs [A, B − 1, RANKS], labels [A, B − 1]) of the drafter's block
    anchored at each of its A answer positions that has a successor (labels −100 past the answer's end)."""
    rows = []
    for r in range(len(data)):
        anchors = torch.arange(int(data.starts[r]), int(data.lengths[r]) - 1, device=data.tokens.device)
        ids, lps, labels = [], [], []
        for c in range(0, len(anchors), chunk):
            _, logits, lab = block_loss(drafter, engine.model, data, torch.tensor([r], device=anchors.device),
                                        anchors[None, c:c + chunk])
            v, i = logits[0].float().log_softmax(-1).topk(RANKS, -1)  # [M, B − 1, RANKS]
            ids.append(i.cpu()), lps.append(v.cpu()), labels.append(lab[0].cpu())
        rows.append((torch.cat(ids), torch.cat(lps), torch.cat(labels)))
    return rows


def truth_ranks(ids: torch.Tensor, labels: torch.Tensor) -> list[int]:
    """ids [B − 1, RANKS], labels [B − 1] -> the rank of each answer token among the choices, up to the first that
    holds none (or the answer's end)."""
    out = []
    for d in range(labels.shape[0]):
        hit = (ids[d] == labels[d]).nonzero()
        if labels[d] < 0 or not len(hit):
            break
        out.append(int(hit[0]))
    return out


def depth(tree: set[tuple[int, ...]], ranks: list[int]) -> int:
    """Accepted drafts of a tree (paths of ranks, prefix-closed): the deepest prefix of `ranks` it holds."""
    d = 0
    while d < len(ranks) and tuple(ranks[:d + 1]) in tree:
        d += 1
    return d


def best_first(score, n: int, depth_max: int) -> list[tuple[int, ...]]:
    """The n paths of ranks of highest total `score(depth, rank)` (log-probabilities: a child never outscores its
    parent), in the order chosen: parents first."""
    heap = [(-score(0, r), (r,)) for r in range(RANKS)]
    heapq.heapify(heap)
    nodes = []
    while heap and len(nodes) < n:
        s, path = heapq.heappop(heap)
        nodes.append(path)
        if len(path) < depth_max:
            for r in range(RANKS):
                heapq.heappush(heap, (s - score(len(path), r), path + (r,)))
    return nodes


def tau(rows, accept) -> tuple[float, int]:
    """(committed tokens / verify steps, steps) walking each answer as the loop does: a block at the answer's first
    token, the next where the last one's accepted drafts and the target's token end."""
    tokens = steps = 0
    for ids, lps, labels in rows:
        a, end = 0, labels.shape[0]
        while a < end:
            k = min(accept(ids[a], lps[a], labels[a]) + 1, end - a)
            tokens, steps, a = tokens + k, steps + 1, a + k
    return tokens / max(steps, 1), steps


def rank_rates(rows, width: int) -> torch.Tensor:
    """[width, RANKS]: how often the answer's token holds each rank at each depth, given the depths before it held
    some rank (every anchor counted)."""
    hits, seen = torch.zeros(width, RANKS), torch.zeros(width)
    for ids, _, labels in rows:
        for a in range(labels.shape[0]):
            ranks = truth_ranks(ids[a], labels[a])
            for d, r in enumerate(ranks):
                hits[d, r] += 1
            seen[:min(len(ranks) + 1, width)] += 1
    return hits / seen[:, None].clamp(min=1)


def shapes(calibration, width: int, nodes: list[int]) -> dict:
    """name -> accept(ids, lps, labels) -> accepted drafts, for every verify shape of the module docstring."""
    line = {tuple([0] * d) for d in range(1, width + 1)}
    out = {"linear": lambda ids, lps, lab: depth(line, truth_ranks(ids, lab))}
    for c in (2, 4):
        tree = {(r,) + (0,) * d for r in range(c) for d in range(width)}
        out[f"top-{c} ({c * width} nodes)"] = lambda ids, lps, lab, t=tree: depth(t, truth_ranks(ids, lab))
    rates = rank_rates(calibration, width).clamp(min=1e-9).log()
    near = pool_paths(width)  # the loop's pool (`spec.tree`)
    for n in nodes:
        out[f"best-first {n}"] = lambda ids, lps, lab, n=n: depth(
            set(best_first(lambda d, r: float(lps[d, r]), n, width)), truth_ranks(ids, lab))
        static = best_first(lambda d, r: float(rates[d, r]), n, width)
        out[f"static {n}"] = lambda ids, lps, lab, t=set(static): depth(t, truth_ranks(ids, lab))
        pool = best_first(lambda d, r: float(rates[d, r]), 8 * n, width)
        out[f"top-{n} of static {8 * n}"] = lambda ids, lps, lab, n=n, pool=pool: depth(
            top_of(pool, lps, n), truth_ranks(ids, lab))
        out[f"top-{n} of rank-sum <= 2 ({len(near)})"] = lambda ids, lps, lab, n=n: depth(
            top_of(near, lps, n), truth_ranks(ids, lab))
    return out



def top_of(pool: list[tuple[int, ...]], lps: torch.Tensor, n: int) -> set[tuple[int, ...]]:
    """The n paths of `pool` (parents before children) of highest marginal log-probability (ties: the earlier)."""
    score: dict[tuple[int, ...], float] = {}
    for p in pool:
        score[p] = score.get(p[:-1], 0.0) + float(lps[len(p) - 1, p[-1]])
    order = sorted(range(len(pool)), key=lambda i: (-score[pool[i]], i))[:n]
    return {pool[i] for i in order}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="sparsespec/drafters/qwen2.5-coder-1.5b-dflash")
    ap.add_argument("--kinds", default="humaneval")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--nodes", default="15,31,63", help="tree sizes (drafts; the root is one more)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    engine = Engine.from_name(args.target, device=args.device, dtype=dtype)
    drafter = DFlash.load(Path(args.drafter), device=args.device, dtype=getattr(torch, dtype)).eval()
    prompts = [engine.encode(p.text, chat=True)
               for p in make_prompts(args.prompts, "heldout", tuple(args.kinds.split(",")))]
    t0 = time.perf_counter()
    data = regenerate(engine, prompts, drafter.cfg.taps, args.max_new_tokens, 8, progress=True)
    rows = marginals(drafter, engine, data)
    print(f"{len(rows)} answers, {sum(r[2].shape[0] for r in rows)} blocks ({time.perf_counter() - t0:.0f} s)")
    half = len(rows) // 2
    calibration, test = rows[:half], rows[half:]
    width = drafter.cfg.block_size - 1
    table = []
    for name, accept in shapes(calibration, width, nodes).items():
        every, _ = tau(rows, accept)
        held, steps = tau(test, accept)
        table.append({"shape": name, "tau_all": every, "tau_second_half": held, "steps_second_half": steps})
    lines = [f"τ on the loop's schedule, {args.target} answers to {len(rows)} {args.kinds} prompts "
             f"({args.max_new_tokens} tokens), drafter {args.drafter}, block {drafter.cfg.block_size}, {dtype} on "
             f"{args.device}; static shapes calibrated on the first {half} answers", "",
             "| verify shape | τ, all answers | τ, second half |", "|---|---:|---:|"]
    lines += [f"| {r['shape']} | {r['tau_all']:.3f} | {r['tau_second_half']:.3f} |" for r in table]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tree_accept.md").write_text("\n".join(lines) + "\n")
        (out / "tree_accept.json").write_text(json.dumps({"settings": vars(args), "rows": table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
