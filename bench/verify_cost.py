"""A speculative verify step (W tokens a row) against the decode step (1 token) on the GPU: random bf16 weights in
real shapes, CUDA-graph replays of the project's own `CudaGraphStep` (plain and torch.compile'd), the weights-read
floor beside them, and with --profile where each step's time goes (torch.profiler over eager steps, kernels by
total device time). --drafters: random DFlash drafters of these layer counts (block 16, the target's layer shape):
their draft step (block forward, LM head, argmax) and context update (16 positions) as CUDA graphs (`DraftGraphs`),
as graphs of their torch.compile'd forwards, and eagerly, against the widest verify step: the draft's share.
--sparse POLICY[:key=value,...]: also the pass of each width under that policy (a cascade's sparse level,
`Runner.sparse_verify`: the first query selects, every query attends to the selection and the block), graphed
in fixed width, beside the dense step of the same width: what a cascade's round costs against a verify; with the
option select_every=N > 1 also the pass that reuses a kept selection (widths up to N: a reusing pass keeps at
most N - 1 tokens, and the next power of two of those runs its graph).

    python bench/verify_cost.py [--models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b] [--widths 1,4,8,16]
                                [--context 2048] [--batch 1] [--profile] [--drafters 1,5]
                                [--sparse binarypc:budget=0.02] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparsespec.attention import make_policy, parse_spec
from sparsespec.cache import KVCache
from sparsespec.graphs import CudaGraphStep, _step
from sparsespec.models.shapes import SHAPES, random_model
from sparsespec.spec.dflash import DFlash, DFlashConfig, DraftGraphs
from sparsespec.sparse_bench import copy_bandwidth, kernel_times, time_ms


def draft_costs(cfg, target, layers: int, batch: int, context: int, compile: bool = True) -> dict:
    """A random DFlash drafter of `layers` layers (block 16) over a drafter cache holding `context` positions a row
    -> ms of its draft and context-update steps, graphed, graphed after torch.compile (`compile`) and eager."""
    model = DFlash.random(DFlashConfig(cfg, layers=layers, block_size=16))
    B = model.cfg.block_size
    cache = KVCache(model.cfg.layer_config, batch, context + 2 * B, torch.bfloat16, "cuda")
    for t in cache.k + cache.v:
        t.normal_()
    cache.truncate([context] * batch)
    graphs = DraftGraphs(model, target, cache, context + B)
    graphs.tokens.random_(0, cfg.vocab_size)
    graphs.starts.fill_(context)
    graphs.at.fill_(context)
    tokens, starts = graphs.tokens.clone(), graphs.starts.clone()
    positions = context + torch.arange(B, device="cuda").expand(batch, -1)
    features = graphs.features.normal_().clone()
    with torch.inference_mode():
        out = {"params_m": sum(p.numel() for p in model.parameters()) / 1e6,
               "draft_graph": time_ms(graphs.propose_graph.replay),
               "ingest_graph": time_ms(graphs.ingest_graph.replay),
               "draft_eager": time_ms(lambda: model.draft_tokens(target, tokens, starts, cache, context + B)),
               "ingest_eager": time_ms(lambda: model.ingest(features, positions, cache))}
        if compile:
            del graphs
            graphs = DraftGraphs(model, target, cache, context + B, compile=True)
            graphs.tokens.copy_(tokens)
            graphs.starts.fill_(context)
            graphs.at.fill_(context)
            out["draft_compiled"] = time_ms(graphs.propose_graph.replay)
            out["ingest_compiled"] = time_ms(graphs.ingest_graph.replay)
    del graphs, model, cache
    torch.cuda.empty_cache()
    return out


def kernel_table(model, cache, tokens, positions, steps: int = 10, top: int = 12) -> list[tuple[str, float, int]]:
    """Eager steps under torch.profiler -> [(kernel name, us per step, launches per step)] by total time."""
    with torch.inference_mode():
        for _ in range(3):
            _step(model, cache, tokens, positions, (), None)
        torch.cuda.synchronize()
        rows = kernel_times(lambda: _step(model, cache, tokens, positions, (), None), steps, top)
    return [(name[:90], us, n) for name, us, n in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--widths", default="1,4,8,16")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="kernel tables of the widest and the 1-token step")
    ap.add_argument("--no-compile", action="store_true", help="graphs only (no torch.compile'd steps)")
    ap.add_argument("--drafters", default="", help="DFlash layer counts, e.g. 1,5 (the draft step's cost)")
    ap.add_argument("--sparse", default="", help="a policy, e.g. binarypc:budget=0.02: its pass of each width too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64
    bw = copy_bandwidth()
    widths = [int(w) for w in args.widths.split(",")]
    results = []
    for name in args.models.split(","):
        cfg = SHAPES[name]
        model = random_model(cfg)
        weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
        cache = KVCache(cfg, args.batch, args.context + max(widths), torch.bfloat16, "cuda")
        for t in cache.k + cache.v:
            t.normal_()
        cache.truncate([args.context] * args.batch)
        print(f"{name}, batch {args.batch}, context {args.context}: weights floor {weights / bw * 1e3:.3f} ms")
        row = {"model": name, "batch": args.batch, "context": args.context, "weights_floor_ms": weights / bw * 1e3,
               "steps": {}, "sparse": args.sparse}
        policy = None
        if args.sparse:  # its index over the random cache, in fixed width (what a graphed runner steps)
            policy = make_policy(*parse_spec(args.sparse))
            if not policy.blocks:
                raise SystemExit(f"--sparse {args.sparse}: a cascade's pass needs a policy that selects keys")
            with torch.inference_mode():
                policy.build_all(cache, cache.lengths)
                policy.plan_fixed(cache, cache.lengths)
            plan, every = policy.fixed, policy.options.select_every
        for w in widths:
            tokens = torch.randint(0, cfg.vocab_size, (args.batch, w), device="cuda")
            positions = args.context + torch.arange(w, device="cuda").expand(args.batch, -1)
            cell = {}
            for label, compiled in (("graph", False), ("compiled", True)):
                if compiled and args.no_compile:
                    continue
                step = CudaGraphStep(model, cache, w, compile=compiled)
                cell[label] = time_ms(lambda: step(tokens, positions))
                del step
                if policy is None:
                    continue
                # the cascade's passes (`Runner.sparse_verify`): selecting, and reusing in the graphs of up to N slots
                for reuse in (False, True)[:1 + (w <= every)]:
                    plan.block, plan.reusing = True, reuse
                    if reuse:
                        with torch.inference_mode():  # (kept from the selecting pass just timed)
                            plan.selected_at.fill_(args.context - 1)
                    step = CudaGraphStep(model, cache, w, compile=compiled, policy=policy)
                    plan.block = plan.reusing = False
                    cell[f"sparse{' reusing' if reuse else ''} {label}"] = time_ms(lambda: step(tokens, positions))
                    del step
            row["steps"][w] = cell
            base = row["steps"][widths[0]]
            print(f"  width {w:3d}: " + ", ".join(f"{label} {ms:.3f} ms ({ms / base[label]:.2f}x)"
                                                 for label, ms in cell.items()), flush=True)
        for layers in [int(n) for n in args.drafters.split(",") if n]:
            d = draft_costs(cfg, model, layers, args.batch, args.context, compile=not args.no_compile)
            verify = row["steps"][widths[-1]]["graph"]
            step = d["draft_graph"] + d["ingest_graph"] + verify
            d["share_of_step"] = (d["draft_graph"] + d["ingest_graph"]) / step
            row[f"dflash_{layers}_layers"] = d
            compiled = (f" ({d['draft_compiled']:.3f} / {d['ingest_compiled']:.3f} compiled)"
                        if "draft_compiled" in d else "")
            print(f"  DFlash {layers} layers ({d['params_m']:.0f}M): draft {d['draft_graph']:.3f} ms graphed / "
                  f"{d['draft_eager']:.3f} eager, context update {d['ingest_graph']:.3f} / {d['ingest_eager']:.3f}"
                  f"{compiled}; "
                  f"with the width-{widths[-1]} verify (graph) {step:.3f} ms a step, the drafter's share "
                  f"{100 * d['share_of_step']:.0f}%", flush=True)
        if args.profile:
            for w in (widths[0], widths[-1]):
                tokens = torch.randint(0, cfg.vocab_size, (args.batch, w), device="cuda")
                positions = args.context + torch.arange(w, device="cuda").expand(args.batch, -1)
                table = kernel_table(model, cache, tokens, positions)
                row[f"kernels_width_{w}"] = table
                print(f"  eager width {w}, kernels by device time (us per step, launches):")
                for kname, us, n in table:
                    print(f"    {us:9.1f} {n:4d}  {kname}")
        results.append(row)
        del model, cache
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "verify_cost.json").write_text(json.dumps({"bandwidth": bw, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
