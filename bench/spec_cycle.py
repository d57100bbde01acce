"""What one self-speculative cycle costs on the GPU against the steps it is made of (random weights in a real shape,
random K/V at a long context): `speculative_step` with the target drafting γ = block − 1 tokens for itself under a
sparse policy and verifying them densely, timed cycle by cycle as the loop runs it, beside its graph replays timed
alone (the selecting sparse step, the step reusing kept selections, the dense verify of `block` tokens) and the
dense decode step. A cycle minus its steps is the loop's host work that the GPU waits for. `--host-drafts` also
times the cycle with the drafts read back to the host before the verify (the path of sampled rows).

    python bench/spec_cycle.py [--shape qwen2.5-coder-1.5b] [--sizes 16x31744,4x31744,1x31744]
        [--policy binarypc:budget=0.02,select_every=4] [--block 6] [--cycles 30] [--compile [--autotune]]
        [--host-drafts] [--row-invariant] [--fp8-drafts]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sparsespec.attention import make_policy, parse_spec
from sparsespec.attention.policy import device_ints
from sparsespec.graphs import CudaGraphDecodeStep
from sparsespec.runner import Runner
from sparsespec.sampling import SamplingConfig
from sparsespec.sparse_bench import step_model, step_options, time_ms
from sparsespec.spec.decode import speculative_step
from sparsespec.spec.drafters import SelfDrafter


def cycle_ms(runner: Runner, drafter, context: int, block: int, cycles: int) -> float:
    """Median wall ms of a draft-verify step of every row at `context` (rolled back there after each)."""
    B = runner.cache.batch
    gen = torch.Generator().manual_seed(0)
    histories = [torch.randint(0, runner.model.cfg.vocab_size, (context + 1,), generator=gen).tolist()
                 for _ in range(B)]  # row r's pending token sits at slot `context`
    times = []
    for i in range(cycles + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        speculative_step(runner, drafter, histories, [block - 1] * B, [SamplingConfig()] * B, [None] * B, block,
                         [0] * B)
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
        runner.truncate([context] * B)
    return statistics.median(times)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b")
    ap.add_argument("--sizes", default="16x31744,4x31744,1x31744", help="BATCHxCONTEXT,...")
    ap.add_argument("--policy", default="binarypc:budget=0.02,select_every=4", help="the self-drafter's policy")
    ap.add_argument("--block", type=int, default=6)
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--host-drafts", action="store_true")
    ap.add_argument("--fp8-drafts", action="store_true", help="the draft steps multiply with FP8 copies of the "
                    "weights (self:...,weights=fp8)")
    ap.add_argument("--out", type=Path)
    step_options(ap)
    args = ap.parse_args()
    cfg, model = step_model(args, args.shape)
    rows = []
    print(f"{args.shape}, random bf16 weights and K/V, self:{args.policy}, block {args.block}, "
          f"compile={args.compile}, FP8 drafts={args.fp8_drafts}; ms")
    print("| batch x context | dense step | select step | reuse step | verify | steps of a cycle | cycle "
          "| host gap | cycle, host drafts | (γ+1)·dense / cycle |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        B, C = (int(x) for x in size.split("x"))
        drafter = SelfDrafter(make_policy(*parse_spec(args.policy)), fp8=args.fp8_drafts)
        runner = Runner(model, B, C + 2 * args.block + 1, drafter.policy, compile=args.compile)
        for t in runner.cache.k + runner.cache.v:
            t.normal_()
        runner.cache.truncate([C] * B)
        runner.build()
        drafter.bind(runner)
        drafter.start([[0]] * B, None, runner.cache.capacity)
        runner.capture_verify(args.block)
        drafter.capture()
        tokens = torch.randint(0, cfg.vocab_size, (B,), device="cuda")
        positions = torch.full((B,), C, device="cuda")
        select = time_ms(lambda: runner.graph(tokens, positions))
        reuse = time_ms(lambda: runner.reuse_graph(tokens, positions)) if runner.reuse_graph else select
        wide = positions[:, None] + torch.arange(args.block, device="cuda")
        verify = time_ms(lambda: runner.verify_graphs[args.block, False](tokens[:, None].expand(-1, args.block), wide))
        runner.truncate([C] * B)
        every = runner.select_every
        selecting = -(-(args.block - 1) // every)
        steps = selecting * select + (args.block - 1 - selecting) * reuse + verify
        cycle = cycle_ms(runner, drafter, C, args.block, args.cycles)
        host = None
        if args.host_drafts:
            on_device = drafter.propose_greedy

            def read_back(histories, ks, device):  # the drafts to the host and back before the verify
                drafts, counts = on_device(histories, ks, device)
                return device_ints(drafts.tolist(), device).view_as(drafts), counts

            drafter.propose_greedy = read_back
            host = cycle_ms(runner, drafter, C, args.block, args.cycles)
        dense = CudaGraphDecodeStep(model, runner.cache, compile=args.compile)
        dense_ms = time_ms(lambda: dense(tokens, positions))
        row = dict(batch=B, context=C, dense_ms=dense_ms, select_ms=select, reuse_ms=reuse, verify_ms=verify,
                   steps_ms=steps, cycle_ms=cycle, host_gap_ms=cycle - steps, host_drafts_cycle_ms=host,
                   ceiling=args.block * dense_ms / cycle)
        rows.append(row)
        print(f"| {B} x {C} | {dense_ms:.3f} | {select:.3f} | {reuse:.3f} | {verify:.3f} | {steps:.3f} "
              f"| {cycle:.3f} | {cycle - steps:.3f} | {'-' if host is None else f'{host:.3f}'} "
              f"| {row['ceiling']:.2f}x |", flush=True)
        del dense, runner, drafter
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spec_cycle.json").write_text(json.dumps(dict(vars(args), out=str(args.out), rows=rows),
                                                             indent=1))


if __name__ == "__main__":
    main()
