"""Where a DFlash draft-verify step's time goes on the GPU, as a line and as a tree verify: random weights in a real
shape (target and a DFlash drafter), random K/V at the context, every part a graph replay timed alone (CUDA events)
beside the whole step as the loop runs it (`speculative_step`, wall clock, synchronised); the step minus its parts
is the host's share that the GPU waits for (Python between the read-back and the next launch, small copies).

    line:  draft (the drafter's block, its argmax)   verify (block_size tokens)   ingest (the context update)
    tree:  choices (each position's top R, log-probs)   tree (choose the n nodes, the block)   verify (n + 1 tokens,
           ancestor masks)   argmax   settle (accept, K/V compaction, path features, the read-back table)   ingest

Also the dense decode step (the plain loop's step) for scale, and with --profile the kernels of one step of each
(torch.profiler: device time by kernel, largest first).

    python bench/tree_cycle.py [--shape qwen2.5-coder-1.5b] [--sizes 1x1024,4x1024] [--nodes 15] [--block 16]
        [--layers 3] [--intermediate 2048] [--window N] [--steps 30] [--compile] [--profile] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sparsespec.attention.policy import device_ints
from sparsespec.graphs import CudaGraphDecodeStep
from sparsespec.runner import Runner
from sparsespec.sampling import SamplingConfig
from sparsespec.sparse_bench import kernel_times, step_model, step_options, time_ms
from sparsespec.spec.decode import speculative_step, tree_verify
from sparsespec.spec.dflash import DFlash, DFlashConfig, DFlashDrafter


def step_ms(runner: Runner, drafter: DFlashDrafter, tree, histories: list[list[int]], block: int,
            steps: int) -> float:
    """Median wall ms of a draft-verify step of every row (target and drafter put back at the context after each)."""
    B, context = len(histories), len(histories[0]) - 1
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        speculative_step(runner, drafter, histories, [block - 1] * B, [SamplingConfig()] * B, [None] * B, block,
                         [0] * B, tree)
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
        runner.truncate([context] * B)
        drafter.cache.truncate([context] * B)
    return statistics.median(times)


def parts_ms(runner: Runner, drafter: DFlashDrafter, tree, histories: list[list[int]], block: int) -> dict:
    """Each part of one step timed alone (the inputs it would get; K/V moves and context writes land at the
    context's slots, which every step rewrites)."""
    B, context, dev = len(histories), len(histories[0]) - 1, runner.device
    ks, lengths = [block - 1] * B, [context] * B
    features = torch.randn(B, block, drafter.model.fc.in_features, device=dev, dtype=torch.bfloat16)
    out = {}
    if tree is None:
        drafts, _ = drafter.propose_greedy(histories, ks, dev)
        out["draft"] = time_ms(lambda: drafter.propose_greedy(histories, ks, dev))
        tokens = torch.cat([drafts.new_zeros(B, 1), drafts[:, :block - 1]], 1)
        out["verify"] = time_ms(lambda: runner.verify(tokens, block))
    else:
        n, width = tree.n, tree.pool.width
        ids, logp, _ = drafter.propose_choices(histories, ks, dev)
        out["choices"] = time_ms(lambda: drafter.propose_choices(histories, ks, dev))
        rows = device_ints([[0] * B, lengths, [min(k, width) for k in ks], [1] * B], dev)
        out["tree"] = time_ms(lambda: tree.draft(ids[:, :width], logp[:, :width], rows[0], rows[2]))
        tokens, plan = tree.draft(ids[:, :width], logp[:, :width], rows[0], rows[2])
        tokens, plan = tokens.clone(), (plan[0].clone(), plan[1].clone())
        out["verify"] = time_ms(lambda: runner.verify(tokens, n + 1, tree=plan))
        logits, feats = runner.verify(tokens, n + 1, tree=plan)
        out["argmax"] = time_ms(lambda: logits.argmax(-1))
        targets = logits.argmax(-1)
        out["settle"] = time_ms(lambda: tree.settle(targets, feats, rows[3] != 0, rows[1], runner.cache))
        features = torch.randn(B, width + 1, drafter.model.fc.in_features, device=dev, dtype=torch.bfloat16)

    def commit():  # the context update of one accepted token a row (as the loop's commit; put back each time)
        drafter.cache.truncate(lengths)
        drafter.commit([n + 2 for n in lengths], [1] * B, features)

    out["ingest"] = time_ms(commit)
    runner.truncate(lengths)
    drafter.cache.truncate(lengths)
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-coder-1.5b")
    ap.add_argument("--sizes", default="1x1024,4x1024", help="BATCHxCONTEXT,...")
    ap.add_argument("--nodes", type=int, default=15, help="the tree's drafted nodes (its verify: nodes + 1 tokens)")
    ap.add_argument("--block", type=int, default=16, help="the drafter's block and the line's verify width")
    ap.add_argument("--layers", type=int, default=3, help="drafter layers (the shipped 1.5B drafter: 3)")
    ap.add_argument("--intermediate", type=int, default=2048, help="drafter MLP width (the shipped 1.5B's: 2048)")
    ap.add_argument("--window", type=int, default=0, help="the drafter's context window (0: the whole context)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also the kernels of a step of each (torch.profiler)")
    ap.add_argument("--out", type=Path)
    step_options(ap)
    args = ap.parse_args()
    cfg, model = step_model(args, args.shape)
    dflash = DFlash.random(DFlashConfig(cfg, layers=args.layers, block_size=args.block,
                                        intermediate_size=args.intermediate, window=args.window))
    print(f"{args.shape}, random bf16 weights and K/V; a random DFlash drafter of {args.layers} layers, block "
          f"{args.block}, context window {args.window or 'none'}; tree of {args.nodes} nodes; "
          f"compile={args.compile}; ms")
    print("| batch x context | verify as | draft | tree | verify | argmax | settle | ingest | parts | step "
          "| host | dense step |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows, kernels = [], {}
    for size in args.sizes.split(","):
        B, C = (int(x) for x in size.split("x"))
        gen = torch.Generator().manual_seed(0)
        histories = [torch.randint(0, cfg.vocab_size, (C + 1,), generator=gen).tolist() for _ in range(B)]
        dense_ms = None
        for nodes in (0, args.nodes):
            drafter = DFlashDrafter(dflash, model)
            drafter.tree_nodes = nodes
            runner = Runner(model, B, C + 2 * max(args.block, nodes + 1), compile=args.compile, taps=dflash.cfg.taps)
            for t in runner.cache.k + runner.cache.v:
                t.normal_()
            runner.cache.truncate([C] * B)
            tree = tree_verify(drafter, args.block, runner.device)
            drafter.bind(runner)
            drafter.start([h[:-1] for h in histories], None, runner.cache.capacity)
            for t in drafter.cache.k + drafter.cache.v:
                t.normal_()
            runner.capture_verify(args.block)
            if tree is not None:
                runner.capture_verify(nodes + 1, tree=True)
                tree.bind(runner)
            parts = parts_ms(runner, drafter, tree, histories, args.block)
            step = step_ms(runner, drafter, tree, histories, args.block, args.steps)
            if dense_ms is None:
                dense = CudaGraphDecodeStep(model, runner.cache, compile=args.compile)
                tokens, positions = torch.zeros(B, dtype=torch.long, device="cuda"), torch.full((B,), C, device="cuda")
                dense_ms = time_ms(lambda: dense(tokens, positions))
                del dense
            label = "line" if tree is None else f"tree{nodes}"
            if args.profile:
                def one():
                    speculative_step(runner, drafter, histories, [args.block - 1] * B, [SamplingConfig()] * B,
                                     [None] * B, args.block, [0] * B, tree)
                    runner.truncate([C] * B)
                    drafter.cache.truncate([C] * B)
                kernels[f"{B}x{C} {label}"] = [(name[:90], us, k) for name, us, k in kernel_times(one, 10, 15)]
            total = sum(parts.values())
            row = dict(batch=B, context=C, verify_as=label, **{f"{k}_ms": v for k, v in parts.items()},
                       parts_ms=total, step_ms=step, host_ms=step - total, dense_ms=dense_ms)
            rows.append(row)
            cell = lambda k: f"{parts[k]:.3f}" if k in parts else "-"  # noqa: E731
            print(f"| {B} x {C} | {label} | {cell('draft') if tree is None else cell('choices')} | {cell('tree')} "
                  f"| {cell('verify')} | {cell('argmax')} | {cell('settle')} | {cell('ingest')} | {total:.3f} "
                  f"| {step:.3f} | {step - total:.3f} | {dense_ms:.3f} |", flush=True)
            del runner, drafter, tree
            torch.cuda.empty_cache()
    for name, table in kernels.items():
        print(f"\n{name}: kernels by device time (us a step, launches)")
        for kernel, us, k in table:
            print(f"  {us:9.1f}  {k:4d}  {kernel}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tree_cycle.json").write_text(json.dumps(dict(vars(args), out=str(args.out), rows=rows,
                                                                  kernels=kernels), indent=1))


if __name__ == "__main__":
    main()
