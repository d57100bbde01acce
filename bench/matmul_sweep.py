"""The decode step's matrix products, one kind at a time (GPU): cuBLAS (F.linear) against the row-invariant Triton
kernel over a grid of tilings, at the row counts of decode and verify steps. Each product is timed as a model runs
it: one CUDA graph of every layer's call, each layer its own random weight (so the weights come from memory, not
from L2), replayed; time per call, and its bandwidth over the weight bytes. Checks every tiling against the torch
reference once. Random bf16 weights in a real shape.

    python bench/matmul_sweep.py [--shapes qwen2.5-coder-1.5b,qwen2.5-coder-0.5b] [--rows 1,16,128] [--out FILE.json]

Prints per (shape, rows): each product's cuBLAS time and the best tiling's (and with FP8 weights, as a drafter's
steps multiply with `weights=fp8`: TB/s over the FP8 bytes), and the sum over a whole step's products (every layer,
and the LM head) for cuBLAS, for the plain tiling, for `tiles_for`'s, for the best tiling of each product and for FP8
weights.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from sparsespec.config import ModelConfig
from sparsespec.graphs import capture
from sparsespec.kernels.matmul import TILES, Tiles, fp8_weights, row_matmul, row_matmul_ref, tiles_for
from sparsespec.models.shapes import shape
from sparsespec.sparse_bench import time_ms

DEVICE = "cuda"
GRID = [Tiles(block_n=n, block_k=k, warps=w, stages=s, waves=v)
        for n, k, w, s, v in itertools.product((16, 32, 64, 128), (64, 128, 256), (4,), (3, 5), (1, 2, 4))]


def products(cfg: ModelConfig) -> dict[str, tuple[int, int, int, bool]]:
    """name -> (N, K, calls a step, bias) of the step's matrix products."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    L = cfg.num_layers
    return {"qkv": (q + 2 * kv, cfg.hidden_size, L, cfg.qkv_bias), "o": (cfg.hidden_size, q, L, cfg.o_bias),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size, L, cfg.mlp_bias),
            "down": (cfg.hidden_size, cfg.intermediate_size, L, cfg.mlp_bias),
            "lm_head": (cfg.vocab_size, cfg.hidden_size, 1, False)}


def per_call_us(fn, x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None) -> float:
    """One graph of fn(x, w, bias) for every w, replayed: us per call."""
    graph, _ = capture(lambda: [fn(x, w, bias) for w in weights], x.device)
    return time_ms(graph.replay, iters=10) * 1e3 / len(weights)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", default="1,16,128", help="rows of a product: a decode step's batch, a verify block's "
                    "batch x width")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results = []
    for name in args.shapes.split(","):
        cfg = shape(name)
        for M in (int(r) for r in args.rows.split(",")):
            print(f"\n{name}, {M} rows (us per call; TB/s over the weight bytes)")
            print("| product | N x K | calls | cuBLAS | plain tiling | the shape's (tiles_for) | best tiling | best "
                  "| best / cuBLAS | FP8 weights, best tiling |")
            print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
            totals = {"cublas": 0.0, "default": 0.0, "chosen": 0.0, "best": 0.0, "fp8": 0.0}
            for prod, (N, K, calls, has_bias) in products(cfg).items():
                weights = [torch.randn(N, K, device=DEVICE, generator=gen, dtype=torch.bfloat16) / K**0.5
                           for _ in range(calls)]
                bias = torch.randn(N, device=DEVICE, generator=gen, dtype=torch.bfloat16) if has_bias else None
                x = torch.randn(M, K, device=DEVICE, generator=gen, dtype=torch.bfloat16)
                ref = row_matmul_ref(x, weights[0], bias).float()
                tb = lambda us: N * K * 2 / (us * 1e-6) / 1e12  # noqa: E731
                cublas = per_call_us(F.linear, x, weights, bias)
                times = {}
                for tiles in GRID:
                    try:
                        y = row_matmul(x, weights[0], bias, tiles=tiles).float()
                    except OutOfResources:  # its pipeline stages do not fit in shared memory
                        continue
                    err = ((y - ref).abs() / (ref.abs() + 1e-2)).max().item()
                    if err > 0.05:
                        raise SystemExit(f"{prod} {tiles}: relative error {err:.3g} against the reference")
                    times[tiles] = per_call_us(lambda a, w, b, t=tiles: row_matmul(a, w, b, tiles=t), x, weights,
                                               bias)
                best, chosen = min(times, key=times.get), tiles_for(N, K)
                scaled = [fp8_weights(w) for w in weights]  # the drafts' copies (self:...,weights=fp8)
                graph, _ = capture(lambda: [row_matmul(x, w8, bias, tiles=best, scale=sc) for w8, sc in scaled],
                                   x.device)
                fp8 = time_ms(graph.replay, iters=10) * 1e3 / calls
                del graph, scaled
                row = {"shape": name, "rows": M, "product": prod, "N": N, "K": K, "calls": calls,
                       "cublas_us": cublas, "default_us": times[TILES],
                       "chosen_us": times[chosen], "best_us": times[best], "fp8_us": fp8,
                       "best": best.__dict__, "all": [[t.__dict__, us] for t, us in times.items()]}
                results.append(row)
                for key, us in (("cublas", cublas), ("default", times[TILES]), ("chosen", times[chosen]),
                                ("best", times[best]), ("fp8", fp8)):
                    totals[key] += us * calls
                b = best
                print(f"| {prod} | {N} x {K} | {calls} | {cublas:.1f} ({tb(cublas):.2f}) | {times[TILES]:.1f} "
                      f"({tb(times[TILES]):.2f}) | {times[chosen]:.1f} ({tb(times[chosen]):.2f}) | {times[best]:.1f} "
                      f"({tb(times[best]):.2f}) | n{b.block_n} "
                      f"k{b.block_k} w{b.warps} s{b.stages} v{b.waves} | {times[best] / cublas:.2f} "
                      f"| {fp8:.1f} ({tb(fp8) / 2:.2f}) |")
                del weights
            weight_bytes = sum(N * K * 2 * calls for N, K, calls, _ in products(cfg).values())
            print(f"| **a step's products** | {weight_bytes / 1e9:.2f} GB | | {totals['cublas'] / 1e3:.3f} ms | "
                  f"{totals['default'] / 1e3:.3f} ms | {totals['chosen'] / 1e3:.3f} ms | "
                  f"{totals['best'] / 1e3:.3f} ms | | "
                  f"{totals['best'] / totals['cublas']:.2f} | {totals['fp8'] / 1e3:.3f} ms |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
