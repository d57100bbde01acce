"""Double-P's build on the GPU: the k-means assignment kernel by precision and tiling, then one layer's whole
build by precision and sample (at the default k-means iterations), against the fp32 build (random bf16 keys in
Llama-3.1-8B heads).

    python bench/kmeans_build.py [--shapes 1x131072,16x131072] [--out DIR]

Per build: seconds (after a throwaway build that compiles the kernels), the share of keys whose cluster differs from
the fp32 (ieee, unsampled) build's, and the k-means objective (Σ squared distance of each key to its centroid) over
the fp32 build's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sparsespec.attention import make_policy
from sparsespec.kernels.kmeans import nearest_centroid
from sparsespec.models.shapes import LLAMA31_8B
from sparsespec.sparse_bench import random_cache, time_ms


def build(cache, context: int, batch: int, opts: list[str]) -> tuple[float, object]:
    policy = make_policy("doublep", [*opts, "dense_layers=0"])
    policy.build(0, cache, [context] * batch)  # compiles
    torch.cuda.synchronize()
    start = time.perf_counter()
    policy.build(0, cache, [context] * batch)
    torch.cuda.synchronize()
    return time.perf_counter() - start, cache.policy_state[0]


def objective(cache, st, sinks: int) -> float:
    """Σ over clustered keys of ‖k - centroid‖² (fp32 centroids from the sums)."""
    keys = cache.k[0][:, :, sinks:sinks + st.perm.shape[-1]].float()  # [B, Hkv, N, D]
    a = st.assign[..., sinks:sinks + keys.shape[2]]  # [B, Hkv, N]
    mean = st.key_sum / st.size.clamp_min(1)[..., None].float()
    c = mean.gather(2, a.clamp_min(0)[..., None].expand(-1, -1, -1, keys.shape[-1]))
    return float(((keys - c).square().sum(-1) * (a >= 0)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x131072,16x131072", help="BATCHxCONTEXT,...")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = LLAMA31_8B
    rows = []
    # the assignment kernel alone: one row's 8 KV heads, 128k keys, clusters of 8
    g = torch.Generator(device="cuda").manual_seed(0)
    pts = torch.randn(cfg.num_kv_heads, 131008, cfg.head_dim, device="cuda", generator=g)
    cen = pts[:, ::8].contiguous()
    flops = 2 * pts.shape[0] * pts.shape[1] * cen.shape[1] * cfg.head_dim
    ref = nearest_centroid(pts, cen, precision="ieee", centre=False)
    print(f"nearest_centroid, {tuple(pts.shape)} points, {cen.shape[1]} centroids a head:")
    for precision in ("ieee", "tf32", "bf16"):
        # (fp32 tiles of 128 x 128 take more shared memory than an SM has)
        tilings = {"ieee": [(64, 64, 4)], "tf32": [(64, 64, 4), (128, 64, 8), (128, 32, 4)],
                   "bf16": [(64, 64, 4), (128, 64, 8), (128, 128, 8), (256, 64, 8), (256, 32, 8)]}[precision]
        for bp, bc, warps in tilings:
            fn = lambda: nearest_centroid(pts, cen, precision=precision, centre=False,  # noqa: E731
                                          tiling=(bp, bc, warps))
            ms = time_ms(fn, iters=2, repeats=2)
            agree = float((fn() == ref).float().mean())
            rows.append({"kernel": "nearest_centroid", "precision": precision, "block_p": bp, "block_c": bc,
                         "warps": warps, "ms": ms, "tflops": flops / ms / 1e9, "agree_ieee": agree})
            print(f"  {precision:5s} {bp:4d}x{bc:<4d} warps {warps}: {ms:8.2f} ms, {flops / ms / 1e9:6.1f} TFLOP/s, "
                  f"same cluster as ieee {agree:.4f}")
    del pts, cen, ref
    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        cache = random_cache(cfg, batch, context, layers=1)
        print(f"\nDoubleP.build, one layer, batch {batch}, context {context}:")
        base_assign, base_obj = None, None
        settings = [("ieee", 1.0), ("tf32", 1.0), ("bf16", 1.0), ("bf16", 0.5), ("bf16", 0.25)]
        if batch > 4:
            settings = settings[1:]
        for precision, sample in settings:
            s, st = build(cache, context, batch, [f"kmeans_dot={precision}", f"kmeans_sample={sample}"])
            obj = objective(cache, st, 4)
            if base_assign is None:
                base_assign, base_obj, base_name = st.assign.clone(), obj, f"{precision}, sample {sample}"
            live = base_assign >= 0
            differ = float((st.assign != base_assign)[live].float().mean())
            rows.append({"build": shape, "precision": precision, "sample": sample, "s": s, "objective": obj,
                         "objective_ratio": obj / base_obj, "differ": differ, "base": base_name})
            print(f"  {precision:5s} sample {sample:4.2f}: {s:7.3f} s; keys in another cluster than {base_name}'s "
                  f"{differ:.3f}; objective x{obj / base_obj:.4f}")
        del cache
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "kmeans_build.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
