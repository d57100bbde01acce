"""GPU benchmarks of sparse decode: one attention layer (`sparsespec bench attention`) and the whole decode step
(`sparsespec bench decode`), against SDPA (flash) and the dense CUDA-graph step measured in the same run, with the
bytes-read floor beside each. Random weights and random keys in real shapes (Llama-3.1-8B by default): what is
timed does not depend on the values — except for the policies whose selection follows the attention's shape
(Double-P, top-p: random keys give flat attention, their worst case), which `bench decode --model` measures with real
weights over a cache prefilled with real text.

    attention: per (context, batch): SDPA over the whole context; each policy's fixed-width decode of one layer
               (scoring + selection + attention) replayed as a CUDA graph, and BinaryPC's three stages alone
    decode:    per (batch, context): dense graph, dense compiled graph, sparse graph per policy; the policy's build
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import corpora
from .attention import make_policy, parse_spec
from .cache import KVCache
from .config import ModelConfig
from .errors import SparseSpecError
from .generate import prefill
from .graphs import CudaGraphDecodeStep
from .models.shapes import random_model, shape
from .models.transformer import BLOCK_QUERIES, Transformer



def time_ms(fn, iters: int = 20, repeats: int = 5) -> float:
    """Median over `repeats` of the mean of `iters` back-to-back calls, CUDA events, after a warm-up."""
    for _ in range(3):
        fn()
    results = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        results.append(start.elapsed_time(end) / iters)
    return statistics.median(results)


def kernel_times(fn, steps: int = 10, top: int | None = None) -> list[tuple[str, float, int]]:
    """fn() run `steps` times under torch.profiler -> [(kernel name, us per call of fn, launches per call)], largest
    first (the `top` first), then ("(all kernels)", total us, total launches)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total, calls = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name] += e.device_time_total
            calls[e.name] += 1
    rows = sorted(total, key=total.get, reverse=True)[:top]
    return [(name, total[name] / steps, calls[name] // steps) for name in rows] + [
        ("(all kernels)", sum(total.values()) / steps, sum(calls.values()) // steps)]


def graphed(fn):
    """fn() captured as a CUDA graph -> a replay callable (its outputs are overwritten by each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (read + write)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms(lambda: dst.copy_(src), iters=10) / 1e3)


def step_options(ap) -> None:
    """The options of the GPU step benchmarks (bench/*.py) for the random model and how its steps compile."""
    ap.add_argument("--autotune", action="store_true",
                    help="compiled steps: Inductor benchmarks Triton GEMM templates against cuBLAS for every matrix "
                         "product (max_autotune_gemm) and tunes its fused kernels (coordinate descent); slow")
    ap.add_argument("--row-invariant", action="store_true",
                    help="matrix products of decode and verify steps through the row-invariant kernel")


def step_model(args, model_shape: str) -> tuple[ModelConfig, Transformer]:
    """`step_options` applied -> (the shape's config, a random model of it)."""
    if args.autotune:
        import torch._inductor.config as inductor

        inductor.max_autotune_gemm = True
        inductor.coordinate_descent_tuning = True
    cfg = shape(model_shape)
    model = random_model(cfg)
    if args.row_invariant:
        model.row_invariant()
    return cfg, model


def random_cache(cfg: ModelConfig, batch: int, capacity: int, layers: int | None = None) -> KVCache:
    layer_cfg = cfg if layers is None else dataclasses.replace(cfg, num_layers=layers)
    cache = KVCache(layer_cfg, batch, capacity, torch.bfloat16, "cuda")
    for t in cache.k + cache.v:
        t.normal_()
    return cache


def policy_bytes(policy, batch: int, context: int, cfg: ModelConfig, attended: float) -> float:
    """The fewest bytes one sparse layer must read: the policy's index per token, plus K and V of the attended."""
    kv_row = 2 * cfg.head_dim * 2
    index = {"binarypc": 8 * -(-getattr(policy.options, "bits", 64) // 64), "topk": cfg.head_dim * 2,
             "quest": 2 * cfg.head_dim * 2 / getattr(policy.options, "page", 1), "streaming": 0}.get(policy.name, 0)
    return batch * cfg.num_kv_heads * (context * index + attended * kv_row)


def bench_attention(specs: list[str], contexts: list[int], batches: list[int], model_shape: str = "llama-3.1-8b",
                    out: Path | None = None) -> list[dict]:
    cfg = shape(model_shape)
    bw = copy_bandwidth()
    rows = []
    for context in contexts:
        for batch in batches:
            cache = random_cache(cfg, batch, context, layers=1)
            q = torch.randn(batch, cfg.num_heads, 1, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
            k, v = cache.k[0], cache.v[0]
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            dense_bytes = batch * cfg.num_kv_heads * context * cfg.head_dim * 4
            row = {"context": context, "batch": batch, "sdpa_ms": time_ms(sdpa),
                   "sdpa_floor_ms": dense_bytes / bw * 1e3}
            positions = torch.full((batch,), context - 1, device="cuda")
            for spec in specs:
                name, opts = parse_spec(spec)
                policy = make_policy(name, [o for o in opts if o.partition("=")[0].strip() != "dense_layers"]
                                     + ["dense_layers=0"])  # (one layer: it is the sparse one)
                torch.cuda.synchronize()
                start = time.perf_counter()
                policy.build(0, cache, [context] * batch)
                torch.cuda.synchronize()
                build_s = time.perf_counter() - start
                policy.plan_fixed(cache, [context] * batch)
                policy.begin_step(positions)
                ms = time_ms(graphed(lambda: policy.decode(0, q, cache, positions)))
                kernels = kernel_times(lambda: policy.decode(0, q, cache, positions))  # device time of each kernel
                policy.reset_attended()  # one more step, counted: keys attended per KV head
                policy.decode(0, q, cache, positions)
                policy.stepped(1)
                attended = policy.mean_attended
                floor = policy_bytes(policy, batch, context, cfg, attended) / bw * 1e3
                entry = {"ms": ms, "speedup": row["sdpa_ms"] / ms, "floor_ms": floor, "attended": attended,
                         "build_s": build_s, "kernels_us": kernels}
                if name == "binarypc":
                    entry["stages_ms"] = binarypc_stages(policy, q, cache)
                row[spec] = entry
                policy.end_fixed()
                cache.policy_state[0] = None
            rows.append(row)
            print(json.dumps(row), flush=True)
            del cache
            torch.cuda.empty_cache()
    lines = [f"One attention layer, {cfg.num_heads} q / {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}, bf16, "
             f"random keys; {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s. Each cell: ms "
             "(speedup over SDPA; floor ms).", "",
             "| context | batch | SDPA | " + " | ".join(specs) + " |", "|---:|---:|---:|" + "---:|" * len(specs)]
    for r in rows:
        cells = [f"{r[s]['ms']:.3f} ({r[s]['speedup']:.1f}x; {r[s]['floor_ms']:.3f})" for s in specs]
        lines.append(f"| {r['context']} | {r['batch']} | {r['sdpa_ms']:.3f} ({r['sdpa_floor_ms']:.3f}) | "
                     + " | ".join(cells) + " |")
    lines += ["", "Kernels of each layer (us of device time per decode, the layer run eagerly, and launches; the rest "
              "of a cell's time is the gaps between them):", ""]
    for r in rows:
        for spec in specs:
            lines.append(f"- {r['context']} x {r['batch']}, {spec}: " + ", ".join(
                f"{name.split('(')[0][:40] or name} {us:.1f}" + (f" x{n}" if n > 1 else "")  # (templates cut)
                for name, us, n in r[spec]["kernels_us"]))
    for spec in [s for s in specs if s.startswith("binarypc")]:
        lines += ["", f"{spec} by stage (ms, each replayed alone): probe + score | select (radix path / candidate "
                  "path; same selection) | attend", ""]
        for r in rows:
            st = r[spec]["stages_ms"]
            cand = "-" if st["select_candidates"] is None else f"{st['select_candidates']:.3f}"
            lines.append(f"- {r['context']} x {r['batch']}: {st['score']:.3f} | {st['select']:.3f} "
                         f"({st['select_radix']:.3f} / {cand}; {st['paths_equal']}) | {st['attend']:.3f}")
    return report(out, "bench_attention", bw, rows, lines)


def report(out: Path | None, name: str, bandwidth: float, rows: list[dict], lines: list[str]) -> list[dict]:
    """Print the table; with `out`, write it (name.md) and the numbers (name.json) there. Returns the rows."""
    table = "\n".join(lines)
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps({"bandwidth": bandwidth, "rows": rows}, indent=1))
        (out / f"{name}.md").write_text(table + "\n")
    return rows


def binarypc_stages(policy, q: torch.Tensor, cache: KVCache) -> dict[str, float]:
    """Scoring (the policy's scorer: the probe, the keys with the safeguard's forced list, and the copy of the
    sampled slots' keys where the select samples), selection and attention of BinaryPC's fixed-width step, timed
    apart; the selection also on each of its two paths (radix over every key, candidates from a threshold sampled
    from that copy), checked to select the same slots."""
    from .kernels.attend import sparse_decode_attention
    from .kernels.select import same_selection, select_topk

    plan, opts = policy.fixed, policy.options
    B, Hq, _, D = q.shape
    Hkv = cache.k[0].shape[1]
    sk = policy.fixed_keys(0, q, cache)

    def select(sampled=None, out=(plan.idx, plan.count)):
        return select_topk(sk.keys, plan.positions, plan.tokens, sk.forced_from, plan.width, sk.key_bits,
                           sinks=opts.sinks, window=opts.window, extra=sk.extra, extra_n=sk.extra_n, out=out,
                           sampled=sampled, samples=sk.samples)

    stages = {"score": time_ms(graphed(lambda: policy.fixed_keys(0, q, cache))), "select": time_ms(graphed(select)),
              "select_radix": time_ms(graphed(lambda: select(False))), "select_candidates": None,
              "paths_equal": None}
    if sk.key_bits <= 16:  # the candidate path takes keys of up to 16 bits (wider probes make 32-bit keys)
        radix = tuple(t.clone() for t in select(False))
        stages["paths_equal"] = same_selection(radix, select(True, out=tuple(torch.empty_like(t) for t in radix)))
        stages["select_candidates"] = time_ms(graphed(lambda: select(True)))
    select()
    attend = lambda: sparse_decode_attention(q.view(B, Hq, D), cache.k[0], cache.v[0],  # noqa: E731
                                             plan.idx.view(B, Hkv, -1), plan.count.view(B, Hkv))
    return stages | {"attend": time_ms(graphed(attend))}


# (row key, column name, block_queries (0: SDPA), torch.compile) of the dense steps timed beside the sparse ones
DENSE_VARIANTS = [("dense_ms", "dense graph", BLOCK_QUERIES, False),
                  ("dense_sdpa_ms", "dense graph (SDPA)", 0, False),
                  ("dense_compiled_ms", "dense compiled", BLOCK_QUERIES, True),
                  ("dense_compiled_sdpa_ms", "dense compiled (SDPA)", 0, True)]


def text_rows(tokenizer, corpus: str, batch: int, tokens: int) -> list[list[int]]:
    """`batch` rows of `tokens` token ids, each from its own seeded run of `corpus` documents."""
    rows = []
    for seed in range(batch):
        ids = tokenizer(corpora.text(corpus, words=tokens, seed=seed))["input_ids"]
        if len(ids) < tokens:
            raise SparseSpecError(f"the {corpus} corpus gave {len(ids)} tokens for a row, fewer than {tokens}")
        rows.append(ids[:tokens])
    return rows


def bench_decode(specs: list[str], shapes: list[tuple[int, int]], model_shape: str = "llama-3.1-8b",
                 compile: bool = True, out: Path | None = None, prefill_batch1: bool = True, engine=None,
                 corpus: str = "wiki") -> list[dict]:
    """`prefill_batch1`: also time the dense prefill of batch-1 shapes, which a policy's build follows. `engine`
    (real weights in bf16 on CUDA) in place of random weights: each row's cache is the prefill of its own window of
    real `corpus` text and the step decodes the text's next token, so what a policy selects — and what a
    data-dependent one costs — follows real attention."""
    # (one compilation per (batch, context) of the dense step, per layer, shape and policy around sparse graph
    # breaks: `graphs.capture` lifts Dynamo's recompile limits for them)
    bw = copy_bandwidth()
    if engine is None:
        cfg = shape(model_shape)
        model = random_model(cfg)
        what = f"{model_shape} shape, random bf16 weights and keys"
    else:
        cfg, model = engine.config, engine.model
        what = (f"{engine.loaded.source.name}, real weights (bf16), each row's cache the prefill of its own {corpus} "
                "text, the step decoding the text's next token")
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if cfg.tie_embeddings:  # the LM head reads the embedding matrix every step
        weights += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    rows = []
    for batch, context in shapes:
        text = None if engine is None else text_rows(engine.tokenizer, corpus, batch, context + 1)
        if text is None:
            cache = random_cache(cfg, batch, context + 1)
            cache.truncate([context] * batch)
            tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
        else:
            cache = KVCache(cfg, batch, context + 1, torch.bfloat16, "cuda")
            tokens = torch.tensor([r[context] for r in text], device="cuda")
        positions = torch.full((batch,), context, device="cuda")
        kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * (context + 1) * cfg.head_dim * 2
        row = {"batch": batch, "context": context, "dense_floor_ms": (weights + kv) / bw * 1e3,
               "weights_floor_ms": weights / bw * 1e3}
        if text is not None or (batch == 1 and prefill_batch1):  # batch 1: what the build is compared with
            prompts = ([r[:context] for r in text] if text is not None
                       else [torch.randint(0, cfg.vocab_size, (context,)).tolist()])
            torch.cuda.synchronize()
            start = time.perf_counter()
            prefill(model, cache, prompts, chunk=8192)
            torch.cuda.synchronize()
            if batch == 1:
                row["prefill_s"] = time.perf_counter() - start
        # the engine's dense step (Triton block attention) and the same step on SDPA (cuDNN: a little faster over a
        # full cache, not deterministic), each also compiled: the best of them is the dense the policies must beat
        reference = None
        for key, _, queries, compiled in DENSE_VARIANTS:
            if compiled and not compile:
                continue
            model.block_queries = queries
            dense = CudaGraphDecodeStep(model, cache, compile=compiled)
            row[key] = time_ms(lambda: dense(tokens, positions))
            reference = dense(tokens, positions).clone() if reference is None else reference
            del dense
        model.block_queries = BLOCK_QUERIES
        best_dense = min(row[v[0]] for v in DENSE_VARIANTS if v[0] in row)
        for spec in specs:
            name, opts = parse_spec(spec)
            warm = make_policy(name, opts)  # one sparse layer's build compiles its kernels: not the build's cost
            warm.build(next(i for i in range(cfg.num_layers) if warm.is_sparse(i)), cache, cache.lengths)
            cache.policy_state = [None] * cfg.num_layers
            del warm
            policy = make_policy(name, opts)
            torch.cuda.synchronize()
            start = time.perf_counter()
            policy.build_all(cache, cache.lengths)
            torch.cuda.synchronize()
            build_s = time.perf_counter() - start
            policy.plan_fixed(cache, cache.lengths)
            sparse = CudaGraphDecodeStep(model, cache, policy=policy)
            policy.append_all(cache, cache.lengths)  # the warm-up steps ran at the last slot
            ms = time_ms(lambda: sparse(tokens, positions))
            logits = sparse(tokens, positions).clone()
            del sparse
            cell = {"graph_ms": ms}
            if compile:  # the same step through torch.compile (the sparse calls stay outside its graphs)
                sparse_c = CudaGraphDecodeStep(model, cache, compile=True, policy=policy)
                policy.append_all(cache, cache.lengths)
                cell["compiled_ms"] = time_ms(lambda: sparse_c(tokens, positions))
                cell["compiled_max_logit_diff"] = float((sparse_c(tokens, positions) - logits).abs().max())
                del sparse_c
                ms = min(ms, cell["compiled_ms"])
            if policy.options.select_every > 1:  # the step between selections: the kept selections reused
                times = []
                for compiled in (False, True) if compile else (False,):
                    policy.fixed.reusing = True
                    try:
                        reusing = CudaGraphDecodeStep(model, cache, compile=compiled, policy=policy)
                    finally:
                        policy.fixed.reusing = False
                    times.append(time_ms(lambda: reusing(tokens, positions)))
                    del reusing
                cell["reusing_ms"] = min(times)
            if "reusing_ms" in cell:  # a selecting step and N - 1 reusing ones: the mean step of a cycle
                every = policy.options.select_every
                cell["cycle_ms"] = (ms + (every - 1) * cell["reusing_ms"]) / every
                cell["cycle_speedup_vs_best"] = best_dense / cell["cycle_ms"]
            row[spec] = {**cell, "ms": ms, "speedup_vs_graph": row["dense_ms"] / ms,
                         "speedup_vs_best": best_dense / ms, "build_s": build_s,
                         "logits_finite": bool(torch.isfinite(logits).all()),
                         "top1_agree": float((logits.argmax(-1) == reference.argmax(-1)).float().mean())}
            policy.end_fixed()
            cache.policy_state = [None] * cfg.num_layers
            torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del cache
        torch.cuda.empty_cache()
    lines = [f"Whole decode step, {what}; {torch.cuda.get_device_name()}, "
             f"copy bandwidth {bw / 1e12:.2f} TB/s. Each cell: the faster of the sparse graph and the compiled "
             "sparse graph, ms per step (speedup over the dense graph / over the best dense); build: the policy's "
             "index over every layer after prefill (its kernels compiled by a throwaway one-layer build); with "
             "select_every > 1 also the step between selections (the kept selections reused) and the mean step of a "
             "cycle (one selecting step, select_every - 1 reusing ones).", "",
             "| batch | context | floor (weights) | " + " | ".join(v[1] for v in DENSE_VARIANTS) + " | "
             + " | ".join(specs) + " |",
             "|---:|---:|---:|" + "---:|" * (len(DENSE_VARIANTS) + len(specs))]
    for r in rows:
        share = lambda s: (f", {100 * r[s]['build_s'] / r['prefill_s']:.1f}% of prefill"  # noqa: E731
                           if "prefill_s" in r else "")
        reusing = lambda s: (f"; reusing step {r[s]['reusing_ms']:.2f}, mean step of a selection cycle "  # noqa: E731
                             f"{r[s]['cycle_ms']:.2f} = {r[s]['cycle_speedup_vs_best']:.2f}x"
                             if "reusing_ms" in r[s] else "")
        agree = lambda s: (f"; top-1 as dense in {r[s]['top1_agree']:.0%} of rows"  # noqa: E731
                           if engine is not None else "")
        cells = [f"{r[s]['ms']:.2f} ({r[s]['speedup_vs_graph']:.2f}x / {r[s]['speedup_vs_best']:.2f}x; build "
                 f"{r[s]['build_s']:.2f} s{share(s)}{reusing(s)}{agree(s)})" for s in specs]
        lines.append(f"| {r['batch']} | {r['context']} | {r['dense_floor_ms']:.2f} ({r['weights_floor_ms']:.2f}) | "
                     + " | ".join(f"{r.get(v[0], float('nan')):.2f}" for v in DENSE_VARIANTS) + " | "
                     + " | ".join(cells)
                     + " |")
    return report(out, "bench_decode", bw, rows, lines)
