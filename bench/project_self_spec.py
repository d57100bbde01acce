"""A projection (not a measurement) of self-speculation's speed from measured step costs and measured acceptance.

Self-speculation (`--draft self:POLICY`) drafts γ tokens with γ sparse decode steps of the target, then verifies
them with one dense step of γ + 1 tokens. Per cycle it commits τ(γ) tokens, so against dense decoding

    speedup(γ) = τ(γ) · t_dense / (γ · t_sparse + t_verify(γ + 1))

With the drafter's `select_every` N > 1 (`self:binarypc:budget=0.02,select_every=8`) a cycle's draft steps 1,
N + 1, ... select and the others reuse the selections (`t_reuse`, the decode rows' "reusing_ms" of --policy):
γ · t_sparse becomes s · t_sparse + (γ − s) · t_reuse with s = ceil(γ / N).

Inputs, each measured elsewhere and read from its results file:
- t_dense, t_sparse: `sparsespec bench decode` rows (whole decode step, CUDA graphs; t_dense the fastest dense step
  of the row, t_sparse the policy's).
- t_verify(w) = t_dense · r(w): r(w) the measured cost of a w-token verify step over a 1-token step
  (`bench/verify_cost.py`, compiled graphs, interpolated over the measured widths). Those were measured at a short
  context, where the weights dominate a step; at long context the KV cache dominates, and the block attention
  reads it once for every query of the block, so r(w) should not be larger there (an assumption, not measured).
- τ(γ): from the accepted lengths of a `bench spec` run of the drafter (tokens committed per verify step with
  block b). Each draft is taken as accepted with one probability α (a geometric model; α the maximum-likelihood
  fit of the runs, each step's accepted drafts censored at b − 1), so τ(γ) = (1 − α^(γ+1)) / (1 − α).

Or, with --cycle (a `bench/spec_cycle.py` run), every step cost from that one run at its (batch, context): the dense
step, the selecting and reusing sparse steps and the verify of the run's block, whose cost over a dense step is held
flat over the widths projected (at long context the verify reads the cache once whatever its width: an assumption
past the measured width).

    python bench/project_self_spec.py [--decode docs/results/sparse-gpu/bench_decode.json]
        [--spec docs/results/spec-self-cpu/spec.jsonl] [--verify docs/results/verify-cost/verify_cost.json]
        [--policy binarypc:budget=0.02] [--drafter self:binarypc:budget=0.02] [--max-gamma 15]
        [--cycle docs/results/spec-cycle/spec_cycle.json --select-every N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def acceptance(committed: list[list[int]], block: int) -> float:
    """Per-draft acceptance α, maximum likelihood under the geometric model: each step accepts a = c − 1 drafts
    (c committed tokens), a step with a < block − 1 ended at a rejection."""
    accepted = sum(c - 1 for steps in committed for c in steps)
    rejections = sum(c - 1 < block - 1 for steps in committed for c in steps)
    return accepted / (accepted + rejections) if accepted + rejections else 0.0


def tau(alpha: float, gamma: int) -> float:
    """Expected tokens committed per cycle with γ drafts (the verify step's own token included)."""
    return gamma + 1.0 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def verify_ratio(ratios: dict[int, float], width: int) -> float:
    """r(width) by linear interpolation over the measured widths (held flat past the widest)."""
    ws = sorted(ratios)
    if width <= ws[0]:
        return ratios[ws[0]]
    for lo, hi in zip(ws, ws[1:]):
        if width <= hi:
            return ratios[lo] + (ratios[hi] - ratios[lo]) * (width - lo) / (hi - lo)
    return ratios[ws[-1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", default="docs/results/sparse-gpu/bench_decode.json")
    ap.add_argument("--spec", default="docs/results/spec-self-cpu/spec.jsonl")
    ap.add_argument("--verify", default="docs/results/verify-cost/verify_cost.json")
    ap.add_argument("--verify-model", default="qwen2.5-coder-1.5b", help="the verify_cost row whose ratios are used")
    ap.add_argument("--policy", default="binarypc:budget=0.02", help="the sparse step of the decode rows")
    ap.add_argument("--drafter", default="self:binarypc:budget=0.02", help="the drafter of the spec rows")
    ap.add_argument("--block", type=int, default=None, help="block size of the spec run (default: its settings)")
    ap.add_argument("--max-gamma", type=int, default=15)
    ap.add_argument("--cycle", default=None, help="step costs from a bench/spec_cycle.py run (spec_cycle.json)")
    ap.add_argument("--select-every", type=int, default=None,
                    help="--cycle: the select_every projected (default: the drafter's)")
    args = ap.parse_args()

    every = next((int(o.split("=")[1]) for o in args.drafter.split(":")[-1].split(",")
                  if o.startswith("select_every=")), 1)
    spec_rows = [json.loads(line) for line in Path(args.spec).read_text().splitlines() if line.strip()]
    spec_rows = [r for r in spec_rows if r["drafter"] == args.drafter and r["temperature"] == 0]
    if not spec_rows:
        raise SystemExit(f"no greedy rows of {args.drafter} in {args.spec}")
    settings = Path(args.spec).with_name("spec.settings.json")
    block = args.block or json.loads(settings.read_text())["block_size"]
    alpha = acceptance([r["committed"] for r in spec_rows], block)
    measured_tau = sum(sum(r["committed"]) for r in spec_rows) / sum(r["steps"] for r in spec_rows)
    if args.cycle:
        cycle_rows(Path(args.cycle), alpha, measured_tau, block, args)
        return
    decode_rows = json.loads(Path(args.decode).read_text())["rows"]
    verify = next(r for r in json.loads(Path(args.verify).read_text())["rows"] if r["model"] == args.verify_model)
    base = verify["steps"]["1"]["compiled"]
    ratios = {int(w): s["compiled"] / base for w, s in verify["steps"].items()}

    print(f"PROJECTED, not measured. Acceptance α = {alpha:.3f} per draft ({args.drafter}, {len(spec_rows)} prompts, "
          f"block {block}: measured τ {measured_tau:.2f}, model τ({block - 1}) {tau(alpha, block - 1):.2f}); "
          f"verify/decode cost ratios r(w) of {args.verify_model} "
          f"{', '.join(f'{w}: {r:.2f}' for w, r in sorted(ratios.items()))}")
    print()
    print(f"| batch | context | dense step ms | {args.policy} step ms | sparse alone | best γ | τ(γ) | "
          "projected self-speculation |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in decode_rows:
        if args.policy not in row:
            continue
        dense = min(row[k] for k in row if k.startswith("dense") and k.endswith("_ms") and "floor" not in k)
        sparse = row[args.policy]["ms"]
        reuse = row[args.policy].get("reusing_ms", sparse) if every > 1 else sparse
        drafting = lambda g: -(-g // every) * sparse + (g - -(-g // every)) * reuse  # noqa: E731
        best = max(range(1, args.max_gamma + 1),
                   key=lambda g: tau(alpha, g) * dense / (drafting(g) + dense * verify_ratio(ratios, g + 1)))
        speed = tau(alpha, best) * dense / (drafting(best) + dense * verify_ratio(ratios, best + 1))
        shown = f"{sparse:.2f}" + (f" (reusing {reuse:.2f})" if reuse != sparse else "")
        print(f"| {row['batch']} | {row['context']} | {dense:.2f} | {shown} | {dense / sparse:.2f}x | {best} | "
              f"{tau(alpha, best):.2f} | {speed:.2f}x |")


def cycle_rows(path: Path, alpha: float, measured_tau: float, block: int, args) -> None:
    """The projection from one spec_cycle run's step costs, for every γ up to --max-gamma."""
    run = json.loads(path.read_text())
    every = args.select_every or next((int(o.split("=")[1]) for o in run["policy"].split(",")
                                       if o.startswith("select_every=")), 1)
    print(f"PROJECTED, not measured. Acceptance α = {alpha:.3f} per draft ({args.drafter}, block {block}: measured "
          f"τ {measured_tau:.2f}); step costs of {path} ({run['shape']}, random weights, self:{run['policy']}, "
          f"verify of {run['block']} tokens held flat over γ); select_every {every}")
    print()
    print("| batch | context | dense step ms | select / reuse / verify ms | γ | τ(γ) | cycle ms "
          "| projected speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in run["rows"]:
        for g in range(1, args.max_gamma + 1):
            selecting = -(-g // every)
            cycle = selecting * row["select_ms"] + (g - selecting) * row["reuse_ms"] + row["verify_ms"]
            print(f"| {row['batch']} | {row['context']} | {row['dense_ms']:.2f} | {row['select_ms']:.2f} / "
                  f"{row['reuse_ms']:.2f} / {row['verify_ms']:.2f} | {g} | {tau(alpha, g):.2f} | {cycle:.2f} | "
                  f"{tau(alpha, g) * row['dense_ms'] / cycle:.2f}x |")


if __name__ == "__main__":
    main()
