"""Decode-step time on the GPU for a Llama-3.1-8B-shaped model (random bf16 weights) against the memory floor.

The floor is the bytes one step must read (every weight matrix, the B embedding rows, the whole KV cache in use)
divided by the device-to-device copy bandwidth measured in the same run. Steps are CUDA-graph replays.

    python bench/gpu_decode.py --out docs/results   (on the device machine: PYTHONPATH=. python3 ...)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparsespec.cache import KVCache
from sparsespec.config import ModelConfig
from sparsespec.graphs import CudaGraphDecodeStep
from sparsespec.models.transformer import BLOCK_QUERIES, Transformer
from sparsespec.models.shapes import LLAMA31_8B, random_model
from sparsespec.sparse_bench import copy_bandwidth, time_ms


def step_bytes(model: Transformer, cfg: ModelConfig, batch: int, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    embed_rows = batch * cfg.hidden_size * 2
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim * 2
    return weights + embed_rows + kv


# (name, torch.compile, the attention of the step: the Triton block attention (the engine's) or SDPA over the whole
# static cache with a causal mask, as the engine's dense step attended before)
VARIANTS = [("SDPA graph", False, "sdpa"), ("graph", False, "block"), ("compiled graph", True, "block")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--shapes", default=None, help="batch x context pairs instead, e.g. 1x131072,16x32768")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled variant (minutes of compilation)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = [v for v in VARIANTS if not (args.no_compile and v[1])]
    shapes = ([tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else
              [(b, c) for c in map(int, args.contexts.split(",")) for b in map(int, args.batches.split(","))])
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64  # one compilation per (variant, batch, context)
    bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    cfg = LLAMA31_8B
    model = random_model(cfg)
    rows = []
    for batch, context in shapes:
        cache = KVCache(cfg, batch, context, torch.bfloat16, "cuda")
        for t in cache.k + cache.v:
            t.normal_()
        positions = torch.full((batch,), context - 1, device="cuda")  # attend to the full context
        tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
        floor_ms = step_bytes(model, cfg, batch, context) / bw * 1e3
        row = {"batch": batch, "context": context, "floor_ms": floor_ms}
        reference = None
        for name, compiled, attention in variants:
            model.block_queries = 0 if attention == "sdpa" else BLOCK_QUERIES
            start = time.perf_counter()
            step = CudaGraphDecodeStep(model, cache, compile=compiled)
            setup_s = time.perf_counter() - start
            ms = time_ms(lambda: step(tokens, positions))
            logits = step(tokens, positions).clone()
            reference = logits if reference is None else reference
            del step
            row[name] = {"ms": ms, "floor_fraction": floor_ms / ms, "setup_s": setup_s,
                         "max_logit_diff_vs_first": (logits - reference).abs().max().item()}
        rows.append(row)
        del cache
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "gpu_decode.json").write_text(json.dumps(
                {"device": device, "copy_bandwidth": bw, "rows": rows}, indent=1))
    lines = [f"Decode step, Llama-3.1-8B shape, random bf16 weights, {device}, torch {torch.__version__}, "
             f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write). Each cell: ms per step (% of the floor).", "",
             "| batch | context | floor ms | " + " | ".join(v[0] for v in variants) + " |",
             "|---:|---:|---:|" + "---:|" * len(variants)]
    for r in rows:
        cells = [f"{r[name]['ms']:.2f} ({100 * r[name]['floor_fraction']:.0f}%)" for name, _, _ in variants]
        lines.append(f"| {r['batch']} | {r['context']} | {r['floor_ms']:.2f} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        (Path(args.out) / "gpu_decode.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
