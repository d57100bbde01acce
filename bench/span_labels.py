"""What a prompt's own span gives a DFlash drafter's training (`train dflash --spans N`), beside the target's answer:
per prompt kind, how often the target's greedy choice is the text's next token in the last N prompt tokens, how many
of a block's B − 1 positions carry a label (the target's choices up to where the text leaves them:
`block_labels(..., greedy)`) in spans and in the target's own answers, the labelled tokens a prompt gives each way,
and a drafter's τ estimate (uniform anchors, `train.acceptance`) on each — which a span's unlabelled positions cap
(a block's run ends at its first unlabelled position), so beside it the drafter's hit rate at the first position
(always labelled) and over all labelled positions, comparable across the two.

    python bench/span_labels.py --target qwen2.5-coder-1.5b --kinds long-code,long-text --long-chars 8000 \
        --prompts 2 --spans 1024 --max-new-tokens 64 [--drafter PATH] [--window 0] [--device cuda] [--out F.json]

`--drafter` defaults to the target's shipped drafter (`--window` overrides its context window).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from sparsespec.generate import Engine
from sparsespec.spec.dflash import DFlash
from sparsespec.spec.prompts import make_prompts
from sparsespec.spec.registry import drafter_path
from sparsespec.spec.train import Dataset, acceptance, autocast_for, block_loss, regenerate, sample_anchors


def agreement(data: Dataset) -> float:
    """The share of the rows' answer (span) tokens that are the target's own choice after the token before."""
    tokens, _, lengths, cut, greedy = data.batch(torch.arange(len(data), device=data.tokens.device))  # [n, T] each
    at = torch.arange(tokens.shape[1], device=tokens.device)
    scored = (at[None] >= (data.starts - cut)[:, None] - 1) & (at[None] < lengths[:, None] - 1)  # choices of them
    return float((greedy[:, :-1] == tokens[:, 1:])[scored[:, :-1]].float().mean())


def block_stats(drafter: DFlash, target, data: Dataset, anchors: int = 64) -> tuple[float, float, float]:
    """At `anchors` uniform anchors a row: (mean labelled positions of a block, the drafter's argmax = label at block
    position 1, over all labelled positions)."""
    rows = torch.arange(len(data), device=data.tokens.device)
    pos = sample_anchors(data, rows, anchors, torch.Generator(device=data.tokens.device).manual_seed(0))
    _, logits, labels = block_loss(drafter, target, data, rows, pos)  # [n, M, B − 1, V], [n, M, B − 1]
    hit, known = logits.argmax(-1) == labels, labels >= 0
    return (float(known.sum(-1).float().mean()), float(hit[..., 0][known[..., 0]].float().mean()),
            float(hit[known].float().mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default=None, help="a DFlash drafter path (default: the target's shipped one)")
    ap.add_argument("--window", type=int, default=None, help="the drafter's context window (default: its own)")
    ap.add_argument("--kinds", default="long-code,long-text")
    ap.add_argument("--long-chars", type=int, default=8000)
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per kind")
    ap.add_argument("--spans", type=int, default=1024, help="prompt tokens a span")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine = Engine.from_name(args.target, device=args.device, dtype=dtype)
    path = args.drafter or drafter_path(args.target)
    drafter = DFlash.load(path, device=engine.device).eval()
    if args.window is not None:
        drafter.cfg = dataclasses.replace(drafter.cfg, window=args.window)
    taps, B, window = drafter.cfg.taps, drafter.cfg.block_size, drafter.cfg.window
    rows = []
    for kind in args.kinds.split(","):
        t0 = time.perf_counter()
        ids = [engine.encode(p.text, chat=True)
               for p in make_prompts(args.prompts, "heldout", (kind,), 0, args.long_chars)]
        both = regenerate(engine, ids, taps, args.max_new_tokens, len(ids), window=window, spans=args.spans)
        n = torch.arange(len(ids), device=both.tokens.device)
        answers, spans = both.subset(n), both.subset(n + len(ids))  # (a run's set: the answers, then the spans)
        row = {"kind": kind, "prompts": len(ids), "prompt_tokens": sum(map(len, ids)) / len(ids)}
        for name, data in (("answers", answers), ("spans", spans)):
            with autocast_for(engine.device):
                tau = acceptance(drafter, engine.model, data)
                labelled, first, every = block_stats(drafter, engine.model, data)
            row[name] = {"tokens": float((data.lengths - data.starts).float().mean()), "agree": agreement(data),
                         "labelled": labelled, "tau": tau, "hit_first": first, "hit_labelled": every}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    print(f"Prompt spans against answers as DFlash training data: {args.target} ({dtype}, {args.device}), drafter "
          f"{path} (block {B}, window {window or 'none'}), spans of {args.spans} tokens, answers of at most "
          f"{args.max_new_tokens}\n")
    print("| kind | prompt tokens | data | tokens a prompt | target's choice = next token | labelled positions "
          f"of {B - 1} | drafter τ (uniform anchors) | drafter hits, position 1 | drafter hits, labelled |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        for name in ("answers", "spans"):
            d = r[name]
            print(f"| {r['kind']} | {r['prompt_tokens']:.0f} | {name} | {d['tokens']:.0f} | {d['agree']:.3f} | "
                  f"{d['labelled']:.2f} | {d['tau']:.2f} | {d['hit_first']:.3f} | {d['hit_labelled']:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "drafter": str(path), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
