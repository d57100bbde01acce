"""A projection (not a measurement) of DFlash speculation's speed on other target shapes, from measured step costs and
a measured acceptance.

A DFlash cycle verifies one block of b positions (the pending token and b − 1 drafts) and commits τ tokens on
average; it costs the verify step, the drafter's block forward and its context update, so against plain decoding

    speedup = τ · t_decode / (t_verify(b) + t_draft + t_ingest + t_extra)

t_extra (`--extra-ms`, default 0): what a cycle costs beyond a line's, measured elsewhere — for a tree verify
(`treeN:dflash`) the tree's parts (choosing the tree, the tree-masked verify, walking and compacting the accepted
path), e.g. the difference of the line's and the tree's ms a verify step in one `bench spec` run with real weights,
or `bench/tree_cycle.py`'s whole-step columns in the target's shape; taken as the same on the projected shape (an
assumption: those parts read the drafter's choices and move one path's K/V, not the weights).

Inputs, each measured elsewhere and read from its results file:
- τ: tokens committed per verify step of a `bench spec` run of a DFlash drafter (its spec.jsonl, real weights, e.g.
  HumanEval on the 1.5B); taken as what a drafter of the same training would reach on the projected target (an
  assumption: τ depends on the drafter and the target, not on the step costs).
- t_decode, t_verify(b): `bench/verify_cost.py` rows (random weights in each shape, CUDA graphs, compiled where
  measured); t_draft, t_ingest: its `--drafters L` columns (a random drafter of L layers in that shape).
Where the spec run's own target shape is among the rows, the projection for it is printed beside the speedup the
run measured: the model's error where both exist (the run's host overhead, and the prompt lengths, are not in it).

    python bench/project_dflash.py --spec docs/results/spec-gpu-humaneval-1.5b/twelfth/spec.jsonl \
        --verify VERIFY_COST.json [--layers 1] [--drafter dflash:PATH] [--extra-ms 0.28]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def measured_tau(rows: list[dict], drafter: str | None) -> tuple[float, float, str]:
    """(τ over every step of the drafter's rows, the rows' mean speedup, the drafter's name) from spec.jsonl rows."""
    names = sorted({r["drafter"] for r in rows if "dflash" in r["drafter"].split(":")})
    if drafter is None:
        if len(names) != 1:
            raise SystemExit(f"the spec run has DFlash drafters {names}: choose one with --drafter")
        drafter = names[0]
    mine = [r for r in rows if r["drafter"] == drafter]
    if not mine:
        raise SystemExit(f"no rows of drafter {drafter!r} (there are: {', '.join(names)})")
    tau = sum(r["tokens"] for r in mine) / sum(r["steps"] for r in mine)
    return tau, sum(r["speedup"] for r in mine) / len(mine), drafter


def projection(row: dict, tau: float, block: int, layers: int, extra: float = 0.0) -> dict:
    """One verify_cost row (and `extra` ms a cycle beyond a line's) -> the step costs used and the projected
    speedup."""
    kind = "compiled" if "compiled" in row["steps"]["1"] else "graph"
    if str(block) not in row["steps"]:
        raise SystemExit(f"{row['model']}: no verify step of width {block} measured (widths {list(row['steps'])})")
    drafter = row.get(f"dflash_{layers}_layers")
    if drafter is None:
        raise SystemExit(f"{row['model']}: no {layers}-layer drafter measured (run verify_cost.py --drafters {layers})")
    t1, tb = row["steps"]["1"][kind], row["steps"][str(block)][kind]
    # the drafter's steps compiled too where measured so (as `bench spec --compile` runs them)
    draft_kind = "compiled" if kind == "compiled" and "draft_compiled" in drafter else "graph"
    draft, ingest = drafter[f"draft_{draft_kind}"], drafter[f"ingest_{draft_kind}"]
    cycle = tb + draft + ingest + extra
    return {"model": row["model"], "steps": kind, "decode_ms": t1, "verify_ms": tb, "draft_ms": draft,
            "ingest_ms": ingest, "extra_ms": extra, "cycle_ms": cycle, "speedup": tau * t1 / cycle}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="spec.jsonl of a `bench spec` run with a DFlash drafter")
    ap.add_argument("--verify", required=True, help="verify_cost.json of `bench/verify_cost.py --drafters L`")
    ap.add_argument("--drafter", default=None, help="the spec run's drafter name (when it has several)")
    ap.add_argument("--layers", type=int, default=1, help="the measured drafter depth to use (its --drafters L)")
    ap.add_argument("--block", type=int, default=16, help="the verify width (the drafter's block)")
    ap.add_argument("--extra-ms", type=float, default=0.0,
                    help="ms a cycle costs beyond a line's (a tree verify's parts, measured), added to every shape")
    args = ap.parse_args()
    if not 0 <= args.extra_ms < float("inf"):
        raise SystemExit(f"--extra-ms must be a finite number >= 0, got {args.extra_ms}")
    rows = [json.loads(line) for line in Path(args.spec).read_text().splitlines() if line.strip()]
    tau, speedup, drafter = measured_tau(rows, args.drafter)
    settings_file = Path(args.spec).with_name("spec.settings.json")
    target = json.loads(settings_file.read_text()).get("target_name") if settings_file.is_file() else None
    costs = json.loads(Path(args.verify).read_text())["rows"]
    print(f"τ {tau:.2f} measured ({drafter}, {len(rows)} rows of {args.spec}; target {target or 'unknown'}, measured "
          f"speedup {speedup:.2f}x); step costs of {args.verify}, random weights, batch and context as measured.\n")
    print("| target shape | batch, context | decode ms | verify ms (width b) | draft + ingest + extra ms | cycle ms | "
          "speedup |\n|---|---|---:|---:|---:|---:|---:|")
    for row in costs:
        p = projection(row, tau, args.block, args.layers, args.extra_ms)
        mark = f" (measured on real weights: {speedup:.2f}x)" if row["model"] == target else ""
        print(f"| {p['model']} | {row['batch']}, {row['context']} | {p['decode_ms']:.3f} | {p['verify_ms']:.3f} | "
              f"{p['draft_ms']:.3f} + {p['ingest_ms']:.3f} + {p['extra_ms']:.3f} | {p['cycle_ms']:.3f} | "
              f"**{p['speedup']:.2f}x projected**{mark} |")


if __name__ == "__main__":
    main()
