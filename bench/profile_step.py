"""Where a whole decode step's time goes (GPU): the dense compiled step and a sparse policy's step (compiled and not,
with its default dense layers and with none), replayed as CUDA graphs under torch.profiler, kernel by kernel.
Random weights and keys in a real shape (Llama-3.1-8B by default).

    python bench/profile_step.py --policy binarypc:budget=0.02 --shapes 1x32768,4x131072 [--shape qwen2.5-coder-1.5b]
                                [--policy none] [--compiled-only] [--autotune] [--row-invariant]
"""

from __future__ import annotations

import argparse

import torch

from sparsespec.attention import make_policy, parse_spec
from sparsespec.graphs import CudaGraphDecodeStep
from sparsespec.sparse_bench import kernel_times, random_cache, step_model, step_options, time_ms


def kernel_table(label: str, step, tokens: torch.Tensor, positions: torch.Tensor, steps: int = 10,
                 top: int = 30) -> None:
    """Print the step's time and its kernels' device time per step, largest first."""
    ms = time_ms(lambda: step(tokens, positions))
    *kernels, (_, total_us, launches) = kernel_times(lambda: step(tokens, positions), steps, top)
    print(f"\n{label}: {ms:.3f} ms a step; kernel sum {total_us / 1e3:.3f} ms, {launches} launches "
          "(us a step, launches a step):")
    for name, us, n in kernels:
        print(f"  {us:8.1f} {n:4d}  {name[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="binarypc:budget=0.02", help="the sparse policy ('none': the dense step only)")
    ap.add_argument("--compiled-only", action="store_true", help="skip the sparse step without torch.compile")
    ap.add_argument("--shapes", default="1x32768,4x131072", help="BATCHxCONTEXT,...")
    ap.add_argument("--shape", default="llama-3.1-8b", help="the model shape of the random weights")
    step_options(ap)
    args = ap.parse_args()
    cfg, model = step_model(args, args.shape)
    name, opts = parse_spec(args.policy) if args.policy != "none" else (None, [])
    for size in args.shapes.split(","):
        batch, context = (int(x) for x in size.split("x"))
        cache = random_cache(cfg, batch, context + 1)
        cache.truncate([context] * batch)
        tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
        positions = torch.full((batch,), context, device="cuda")
        dense = CudaGraphDecodeStep(model, cache, compile=True)
        kernel_table(f"dense compiled {size}", dense, tokens, positions)
        del dense
        if args.policy == "none":
            continue
        for extra in ([], ["dense_layers=0"]):
            policy = make_policy(name, [*opts, *extra])
            policy.build_all(cache, cache.lengths)
            policy.plan_fixed(cache, cache.lengths)
            for compiled in (True,) if args.compiled_only else (True, False):
                sparse = CudaGraphDecodeStep(model, cache, compile=compiled, policy=policy)
                policy.append_all(cache, cache.lengths)  # the warm-up steps ran at the last slot
                kernel_table(f"{args.policy} {' '.join(extra)} compiled={compiled} {size}", sparse, tokens,
                             positions)
                del sparse
            policy.end_fixed()
            cache.policy_state = [None] * cfg.num_layers
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
