"""Where one sparse attention layer's decode time goes, kernel by kernel (GPU): torch.profiler over eager calls of
a policy's fixed-width decode, random keys in Llama-3.1-8B heads; then the policy's kernels at several tilings
(BinaryPC, top-k, Quest, Double-P).

    python bench/profile_layer.py [--policy binarypc] [--shapes 16x131072,1x131072] [--bare]

`--bare`: the eager steps alone, no torch.profiler and no sweep — for an outside profiler (Nsight Compute), whose
counters the profiler's CUPTI session would contend for.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from sparsespec.attention import make_policy, parse_spec
from sparsespec.models.shapes import LLAMA31_8B
from sparsespec.sparse_bench import random_cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="binarypc")
    ap.add_argument("--shapes", default="16x131072,1x131072", help="BATCHxCONTEXT,...")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bare", action="store_true", help="the steps alone (for Nsight Compute): no profiler, no sweep")
    args = ap.parse_args()
    cfg = LLAMA31_8B
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        cache = random_cache(cfg, batch, context, layers=1)
        q = torch.randn(batch, cfg.num_heads, 1, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        positions = torch.full((batch,), context - 1, device="cuda")
        name, opts = parse_spec(args.policy)
        policy = make_policy(name, [*opts, "dense_layers=0"])
        policy.build(0, cache, [context] * batch)
        policy.plan_fixed(cache, [context] * batch)
        policy.begin_step(positions)
        for _ in range(3 if not args.bare else 3 + args.steps):
            policy.decode(0, q, cache, positions)
        torch.cuda.synchronize()
        if not args.bare:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.steps):
                    policy.decode(0, q, cache, positions)
                torch.cuda.synchronize()
            print(f"\n{args.policy}, batch {batch}, context {context}: per-step device time by kernel "
                  f"(mean over {args.steps} steps)")
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            total = sum(e.device_time_total for e in events) / args.steps
            for e in sorted(events, key=lambda e: -e.device_time_total):
                print(f"  {e.device_time_total / args.steps:9.1f} us  x{e.count // args.steps:<3d} {e.key[:90]}")
            print(f"  {total:9.1f} us  total")
            if name in ("binarypc", "topk", "quest"):
                sweep(name, policy, cache, q, positions, cfg)
            elif name == "doublep":
                sweep_doublep(policy, cache, q, cfg)
        policy.end_fixed()
        del cache
        torch.cuda.empty_cache()


def sweep(name: str, policy, cache, q: torch.Tensor, positions: torch.Tensor, cfg) -> None:
    """The policy's scorer and select at several tuning settings, each captured alone as a CUDA graph and timed."""
    from sparsespec.kernels.binarypc import probe_tables, score_keys
    from sparsespec.kernels.scores import quest_keys, topk_keys
    from sparsespec.kernels.select import select_topk
    from sparsespec.sparse_bench import graphed, time_ms

    def show(label: str, fn) -> None:
        print(f"  {label}: {time_ms(graphed(fn)) * 1e3:.1f} us")

    batch, state, o, plan = q.shape[0], cache.policy_state[0], policy.options, policy.fixed
    qf = q.view(batch, cfg.num_heads, -1)
    if name == "quest":
        for block, warps in ((32, 4), (16, 4), (64, 4), (64, 8), (128, 8), (16, 2)):
            show(f"quest_keys block={block} warps={warps}", lambda: quest_keys(
                qf, cache.k[0], state.kmin, state.kmax, positions, o.page, block=block, num_warps=warps))
        return
    if name == "binarypc":
        _, tables = probe_tables(qf, state.basis, o.probe_bits)
        G = cfg.num_heads // cfg.num_kv_heads
        for block, warps in ((2048, 8), (1024, 4), (4096, 8), (1024, 8)):
            show(f"score_keys block={block} warps={warps}", lambda: score_keys(
                state.codes, tables, positions, o.probe_bits, o.bits, G, block=block, num_warps=warps))
        keys, bits, forced_from = score_keys(state.codes, tables, positions, o.probe_bits, o.bits, G), 16, \
            state.encoded_dev
    else:
        for block, warps in ((128, 8), (64, 4), (128, 4), (256, 8), (64, 8), (32, 4)):
            show(f"topk_keys block={block} warps={warps}", lambda: topk_keys(
                qf, cache.k[0], positions, block=block, num_warps=warps))
        keys, bits, forced_from = topk_keys(qf, cache.k[0], positions), 32, plan.positions + 1
    for block, waves, warps in ((2048, 4, 8), (1024, 4, 4), (1024, 16, 4), (2048, 16, 8), (4096, 4, 8),
                                (512, 8, 4), (1024, 8, 8), (4096, 16, 8)):
        show(f"select_topk block={block} waves={waves} warps={warps}", lambda: select_topk(
            keys, plan.positions, plan.tokens, forced_from, plan.width, bits, sinks=o.sinks, window=o.window,
            out=(plan.idx, plan.count), block=block, waves=waves, num_warps=warps))


def sweep_doublep(policy, cache, q: torch.Tensor, cfg) -> None:
    """Double-P's selection kernels at several tilings, each captured alone as a CUDA graph and timed (the step's
    own inputs: its clusters, masses and thresholds)."""
    from sparsespec.kernels.cluster_select import cluster_masses, kept_tokens, mark_clusters
    from sparsespec.kernels.clusters import cluster_scores
    from sparsespec.sparse_bench import graphed, time_ms

    def show(label: str, fn) -> None:
        print(f"  {label}: {time_ms(graphed(fn)) * 1e3:.1f} us")

    st, o, fx = cache.policy_state[0], policy.options, policy.fixed
    B, Hq, _, D = q.shape
    Hkv = cfg.num_kv_heads
    G, R, C = Hq // Hkv, B * Hkv, st.size.shape[-1]
    qf = q.reshape(B, Hq, D).contiguous()
    qg = qf.view(B, Hkv, G, D)
    idx = torch.empty(R, fx.kept_width + fx.decoded_width + fx.exact_cap, dtype=torch.int32, device=q.device)
    kept_logits, _ = kept_tokens(qf, cache.k[0], fx.positions, st.clustered_end_dev, o.sinks, fx.kept_width, idx)
    for block, warps in ((32, 4), (64, 4), (64, 8), (128, 8), (16, 4)):
        show(f"cluster_scores block={block} warps={warps}", lambda: cluster_scores(
            qg, st.centroids, st.spread, block=block, num_warps=warps))
    logits, ranked = cluster_scores(qg, st.centroids, st.spread)
    args = (ranked.view(R, G, C), st.size.view(R, C), st.members.view(R, C), kept_logits, o.p1, o.p2, fx.exact_cap)
    for block_t, warps in ((16384, 16), (16384, 8), (8192, 16), (4096, 8)):
        show(f"cluster_masses block_t={block_t} warps={warps}", lambda: cluster_masses(
            *args, block_t=block_t, num_warps=warps))
    mass, _, thr = cluster_masses(*args)
    for block, waves in ((32, 4), (64, 4), (16, 4), (32, 2), (32, 8), (32, 10**6)):
        show(f"mark_clusters block={block} waves={waves}", lambda: mark_clusters(
            mass, thr, st.size.view(R, C), logits.view(R, G, C), st.value_mean.view(R, C, D), o.tail == "approx",
            block=block, waves=waves))


if __name__ == "__main__":
    main()
