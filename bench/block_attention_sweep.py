"""The block attention of decode and verify steps over a grid of launches (GPU): at each (batch x context, block
width) of a model's heads, every `BlockTiles` of the grid is checked once against the torch reference and timed as
a step runs it — one CUDA graph of `--layers` calls, each layer its own K/V (so the cache comes from memory, not
from L2), replayed — beside the default launch (`block_tiles`), SDPA with the same mask (PyTorch picks its kernel)
and the bytes floor (the K/V slots the block's queries see, read once, at the copy bandwidth). Random bf16 K/V;
the queries of each row end at its last slot (a verify block at the end of the context), `--tree` as a tree of
the block's width (`spec.tree.choose` over random choices: each query sees the context and its ancestors).

    python bench/block_attention_sweep.py [--shapes qwen2.5-coder-1.5b,llama-3.1-8b] [--sizes 16x25600,4x25600]
        [--widths 1,8,16] [--tree] [--layers 4] [--keys 64,128] [--warps 4,8] [--stages 2,3]
        [--out FILE.json]

A shape is a model's name or heads alone, HQ/HKV/D (e.g. 48/8/128: six query heads a KV head, eight KV heads),
to tell which of the group size and the KV heads a launch's speed follows.

Prints per (shape, size, width): the default launch's time and its bandwidth over the floor's bytes, the best
launch and its time, SDPA's, the floor, and best / default. The JSON has every launch's time.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

from sparsespec.attention.dense import tree_mask
from sparsespec.graphs import capture
from sparsespec.kernels.attend import (BlockTiles, block_attention, block_attention_ref, block_tiles, num_splits,
                                       split_span)
from sparsespec.models.shapes import shape
from sparsespec.sparse_bench import copy_bandwidth, time_ms
from sparsespec.spec.tree import Pool, choose

DEVICE = "cuda"


def grid(default: BlockTiles, keys: list[int], warps: list[int], stages: list[int]) -> list[BlockTiles]:
    """The launches tried: row tiles from 16 up to the default's (all of a block's G * T rows in one), and every
    combination of the key blocks, warps and stages given; the default first."""
    rows = [r for r in (16, 32, 64, 128, 256) if r <= default.rows]
    out = [BlockTiles(r, n, w, s) for r, n, w, s in itertools.product(rows, keys, warps, stages)]
    return [default, *(t for t in out if t != default)]


def heads(name: str) -> tuple[int, int, int]:
    """A model shape's name, or HQ/HKV/D -> (query heads, KV heads, head_dim)."""
    parts = name.split("/")
    if len(parts) == 3:
        Hq, Hkv, D = (int(x) for x in parts)
        if min(Hq, Hkv, D) < 1 or Hq % Hkv or D & (D - 1):
            raise SystemExit(f"{name}: heads HQ/HKV/D need HQ a multiple of HKV and D a power of two")
        return Hq, Hkv, D
    cfg = shape(name)
    return cfg.num_heads, cfg.num_kv_heads, cfg.head_dim


def per_call_us(fn, layers: int) -> float:
    """One graph of fn(layer) for every layer, replayed: us per call."""
    graph, _ = capture(lambda: [fn(i) for i in range(layers)], torch.device(DEVICE))
    us = time_ms(graph.replay, iters=10) * 1e3 / layers
    del graph
    return us


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen2.5-coder-1.5b,llama-3.1-8b")
    ap.add_argument("--sizes", default="16x25600,4x25600,1x32768", help="BATCHxCONTEXT,...")
    ap.add_argument("--widths", default="1,8,16", help="queries a row (1: a decode step; a verify block's width)")
    ap.add_argument("--tree", action="store_true", help="the blocks as trees (widths >= 2)")
    ap.add_argument("--layers", type=int, default=4, help="calls a graph, each over its own K/V")
    ap.add_argument("--keys", default="64,128", help="key blocks tried")
    ap.add_argument("--warps", default="4,8", help="warps tried")
    ap.add_argument("--stages", default="2,3", help="pipeline stages tried")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    results = []
    for name in args.shapes.split(","):
        Hq, Hkv, D = heads(name)
        G = Hq // Hkv
        print(f"\n{name}: {Hq} query heads, {Hkv} KV heads, head_dim {D}; us per layer{' (trees)' * args.tree}")
        print("| batch x context | width | default | default TB/s | best | best launch | SDPA | floor | "
              "best / default |")
        print("|---|---:|---:|---:|---:|---|---:|---:|---:|")
        for size in args.sizes.split(","):
            B, S = (int(x) for x in size.split("x"))
            ks = [torch.randn(B, Hkv, S, D, device=DEVICE, generator=gen, dtype=torch.bfloat16)
                  for _ in range(args.layers)]
            vs = [torch.randn(B, Hkv, S, D, device=DEVICE, generator=gen, dtype=torch.bfloat16)
                  for _ in range(args.layers)]
            for T in (int(w) for w in args.widths.split(",")):
                tree = None
                if args.tree and T > 1:
                    logp, ids = torch.randn(B, T - 1, 50, generator=gen, device=DEVICE).log_softmax(-1).topk(3, -1)
                    tree = choose(Pool.of(T - 1), ids.cpu(), logp.cpu(), T - 1).ancestors.to(DEVICE)
                q = torch.randn(B, T, Hq, D, device=DEVICE, generator=gen, dtype=torch.bfloat16).transpose(1, 2)
                positions = (S - T + torch.arange(T, device=DEVICE)).expand(B, T).contiguous()  # [B, T]
                ref = block_attention_ref(q, ks[0], vs[0], positions, tree=tree).float()
                splits = num_splits(S, B * Hkv, D, q.device)  # (every launch: the default's split count)
                default = block_tiles(G, T, D, q.dtype, False, split_slots=split_span(S, splits))
                times = {}
                for tiles in grid(default, *([int(x) for x in a.split(",")]
                                             for a in (args.keys, args.warps, args.stages))):
                    try:
                        out = block_attention(q, ks[0], vs[0], positions, tree=tree, tiles=tiles).float()
                    except OutOfResources:  # its pipeline stages do not fit in shared memory
                        continue
                    err = ((out - ref).norm() / ref.norm()).item()
                    if err > 2e-2:
                        raise SystemExit(f"{name} {size} T={T} {tiles}: relative error {err:.3g} against the "
                                         f"reference")
                    times[tiles] = per_call_us(
                        lambda i, t=tiles: block_attention(q, ks[i], vs[i], positions, tree=tree, tiles=t),
                        args.layers)
                if tree is None:
                    mask = torch.arange(S, device=DEVICE) <= positions[:, None, :, None]  # [B, 1, T, S]
                else:
                    mask = tree_mask(positions[:, 0], tree, S)[:, None]
                sdpa = per_call_us(lambda i: F.scaled_dot_product_attention(q, ks[i], vs[i], attn_mask=mask,
                                                                            enable_gqa=True), args.layers)
                floor = 2 * B * Hkv * S * D * 2 / bandwidth * 1e6  # K and V read once, at the copy's bytes a second
                best = min(times, key=times.get)
                tb = lambda us: 2 * B * Hkv * S * D * 2 / (us * 1e-6) / 1e12  # noqa: E731
                results.append({"shape": name, "batch": B, "context": S, "width": T, "tree": tree is not None,
                                "default": default.__dict__, "default_us": times[default],
                                "best": best.__dict__, "best_us": times[best], "sdpa_us": sdpa, "floor_us": floor,
                                "all": [[t.__dict__, us] for t, us in times.items()]})
                print(f"| {B} x {S} | {T} | {times[default]:.1f} | {tb(times[default]):.2f} | {times[best]:.1f} | "
                      f"r{best.rows} k{best.keys} w{best.warps} s{best.stages} | {sdpa:.1f} | {floor:.1f} | "
                      f"{times[best] / times[default]:.2f} |")
            del ks, vs
            torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"bandwidth": bandwidth, "triton": triton.__version__,
                                        "torch": torch.__version__, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
