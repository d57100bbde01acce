"""Where a whole decode step's time goes (GPU): the dense compiled step and a sparse policy's step (compiled and not,
with its default dense layers and with none), replayed as CUDA graphs under torch.profiler, kernel by kernel.
Random weights and keys in the Llama-3.1-8B shape.

    python bench/profile_step.py --policy binarypc:budget=0.02 --shapes 1x32768,4x131072
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from sparsespec.attention import make_policy, parse_spec
from sparsespec.graphs import CudaGraphDecodeStep
from sparsespec.models.shapes import LLAMA31_8B, random_model
from sparsespec.sparse_bench import random_cache, time_ms


def kernel_table(label: str, step, tokens: torch.Tensor, positions: torch.Tensor, steps: int = 10,
                 top: int = 30) -> None:
    """Print the step's time and its kernels' device time per step, largest first."""
    ms = time_ms(lambda: step(tokens, positions))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(tokens, positions)
        torch.cuda.synchronize()
    total, calls = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total
            calls[e.name] += 1
    print(f"\n{label}: {ms:.3f} ms a step; kernel sum {sum(total.values()) / steps / 1e3:.3f} ms, "
          f"{sum(calls.values()) // steps} launches (us a step, launches a step):")
    for k in sorted(total, key=total.get, reverse=True)[:top]:
        print(f"  {total[k] / steps:8.1f} {calls[k] // steps:4d}  {k[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="binarypc:budget=0.02")
    ap.add_argument("--shapes", default="1x32768,4x131072", help="BATCHxCONTEXT,...")
    args = ap.parse_args()
    # around a sparse policy's graph breaks Dynamo compiles each decoder layer's frame: allow it
    torch._dynamo.config.recompile_limit = 2048
    torch._dynamo.config.accumulated_recompile_limit = 8192
    cfg = LLAMA31_8B
    model = random_model(cfg)
    name, opts = parse_spec(args.policy)
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        cache = random_cache(cfg, batch, context + 1)
        cache.truncate([context] * batch)
        tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
        positions = torch.full((batch,), context, device="cuda")
        dense = CudaGraphDecodeStep(model, cache, compile=True)
        kernel_table(f"dense compiled {shape}", dense, tokens, positions)
        del dense
        for extra in ([], ["dense_layers=0"]):
            policy = make_policy(name, [*opts, *extra])
            policy.build_all(cache, cache.lengths)
            policy.plan_fixed(cache, cache.lengths)
            for compiled in (True, False):
                sparse = CudaGraphDecodeStep(model, cache, compile=compiled, policy=policy)
                for layer in range(cfg.num_layers):
                    policy.append(layer, cache, cache.lengths)  # the warm-up steps ran at the last slot
                kernel_table(f"{args.policy} {' '.join(extra)} compiled={compiled} {shape}", sparse, tokens,
                             positions)
                del sparse
            policy.end_fixed()
            cache.policy_state = [None] * cfg.num_layers
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
