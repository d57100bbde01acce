"""A policy's fixed-width steps (the logic the GPU's graph runs; on a CPU through the kernels' torch references)
against its eager steps and dense attention, teacher-forced on dense's greedy tokens after a long-code prompt.

    python bench/fixed_vs_eager.py --attention doublep --steps 150 --long-chars 56000

Prints, per 50 steps, the largest |logit difference| between the two paths, and at the end how often the three
argmaxes agree. Real weights (`--model`, default qwen2.5-coder-0.5b), fp32 on the CPU unless `--device cuda`
(`--dtype bfloat16` as the GPU's runs decode).
"""

from __future__ import annotations

import argparse
import time

import torch

from sparsespec.attention import make_policy, parse_spec
from sparsespec.generate import Engine
from sparsespec.runner import Runner
from sparsespec.spec.prompts import make_prompts


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attention", default="doublep")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--long-chars", type=int, default=12000)
    ap.add_argument("--prompt", type=int, default=1, help="which held-out long-code prompt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16 (as the GPU's runs decode)")
    args = ap.parse_args()
    engine = Engine.from_name(args.model, device=args.device, dtype=args.dtype)
    text = make_prompts(args.prompt + 1, "heldout", ("long-code",), 0, args.long_chars)[args.prompt].text
    ids = engine.encode(text, chat=True)
    name, opts = parse_spec(args.attention)
    capacity = len(ids) + args.steps + 1
    runners = {fixed: Runner(engine.model, 1, capacity, make_policy(name, opts), fixed=fixed)
               for fixed in (False, True)}
    for r in runners.values():
        r.prefill([ids])
    dense = Runner(engine.model, 1, capacity)
    token = engine.model.logits(dense.prefill([ids])).argmax(-1)  # [1]
    worst, same, eager_dense, fixed_dense = 0.0, 0, 0, 0
    start = time.time()
    for step in range(args.steps):
        eager, fixed, exact = (r.decode(token) for r in (runners[False], runners[True], dense))  # [1, V] each
        diff = (eager - fixed).abs().max().item()
        worst = max(worst, diff)
        same += int(eager.argmax(-1) == fixed.argmax(-1))
        eager_dense += int(eager.argmax(-1) == exact.argmax(-1))
        fixed_dense += int(fixed.argmax(-1) == exact.argmax(-1))
        if step % 50 == 0:
            print(f"step {step}: max |eager - fixed| logit {diff:.2e}", flush=True)
        token = exact.argmax(-1)  # teacher-forced on dense's greedy text
    n = args.steps
    print(f"{args.attention}: prompt {len(ids)} tokens, {n} steps in {time.time() - start:.0f} s; worst "
          f"|eager - fixed| {worst:.2e}; argmax eager = fixed {same}/{n}, eager = dense {eager_dense}/{n}, "
          f"fixed = dense {fixed_dense}/{n}")


if __name__ == "__main__":
    main()
