"""How well the held-out τ estimates predict what speculative decoding commits: a table of, per prompt kind, the
uniform-anchor estimate (`train.acceptance`, what training tracks), the decoding-schedule estimate
(`train.decoding_acceptance`) and the τ greedy DFlash speculation measures on the same prompts, whose answers both
estimates are teacher-forced on (greedy at T = 0, so the loop follows those answers; a bf16 loop that rounds away
from them follows its own).

    python bench/tau_estimate.py --target qwen2.5-coder-0.5b --drafter PATH --kinds kjv,code --prompts 6 \
        --max-new-tokens 128 [--device cuda] [--out results.json]

`--drafter` defaults to the target's shipped drafter.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from sparsespec.generate import Engine, GenerationConfig
from sparsespec.progress import progress_bar
from sparsespec.runner import RunnerPool
from sparsespec.spec.decode import speculative_generate
from sparsespec.spec.dflash import DFlash, DFlashDrafter
from sparsespec.spec.prompts import make_prompts
from sparsespec.spec.registry import drafter_path
from sparsespec.spec.train import acceptance, autocast_for, decoding_acceptance, regenerate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-0.5b")
    ap.add_argument("--drafter", default=None, help="a DFlash drafter path (default: the target's shipped one)")
    ap.add_argument("--kinds", default="kjv,code")
    ap.add_argument("--prompts", type=int, default=6, help="held-out prompts per kind")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine = Engine.from_name(args.target, device=args.device, dtype=dtype)
    path = args.drafter or drafter_path(args.target)
    drafter = DFlash.load(path, device=engine.device).eval()
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)  # as `regenerate` answers
    runners, loop_drafter = RunnerPool(), DFlashDrafter(drafter, engine.model)  # graphs kept across prompts
    rows = []
    for kind in args.kinds.split(","):
        ids = [engine.encode(p.text, chat=True) for p in make_prompts(args.prompts, "heldout", (kind,), 0)]
        t0 = time.perf_counter()
        data = regenerate(engine, ids, drafter.cfg.taps, args.max_new_tokens, len(ids))
        with autocast_for(engine.device):
            uniform = acceptance(drafter, engine.model, data)
            schedule = decoding_acceptance(drafter, engine.model, data)[0]
        steps = committed = same = 0
        with progress_bar() as bar:
            task = bar.add_task(f"{kind}: speculative decoding", total=len(ids))
            for i, p in enumerate(ids):
                out = speculative_generate(engine, [p], loop_drafter, gen, drafter.cfg.block_size, runners)[0]
                steps, committed = steps + out.steps, committed + sum(out.committed)
                same += out.token_ids == data.sequence(i)[int(data.starts[i]):]
                bar.advance(task)
        rows.append({"kind": kind, "prompts": len(ids), "uniform_estimate": uniform, "schedule_estimate": schedule,
                     "decoding_tau": committed / steps, "same_answers": same,
                     "seconds": round(time.perf_counter() - t0, 1)})
    print(f"Held-out τ estimates against speculative decoding: {args.target} ({dtype}, {args.device}), drafter "
          f"{path}, {args.max_new_tokens} new tokens\n")
    print("| kind | prompts | uniform anchors (training's estimate) | decoding schedule | measured in the loop | "
          "loop answers = estimate's |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['prompts']} | {r['uniform_estimate']:.3f} | {r['schedule_estimate']:.3f} | "
              f"{r['decoding_tau']:.3f} | {r['same_answers']}/{r['prompts']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "drafter": str(path), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
