"""The two paths of `select_topk` on BinaryPC's own keys (CUDA): kernel by kernel (torch.profiler, device time per
select) and whole (a CUDA graph replayed), checked to select the same slots as each other, with the rows the
candidates served (the others fell back to the radix passes: the same selection, more time).

    python3 bench/select_paths.py --shapes 1x131072,4x131072,16x32768,16x131072 [--scan 4x2048,16x1024]
        [--pick 1024,4096] [--radix 1024x4x4,4096x2x8] [--samples 32/16,64/32/4] [--flat-rows 0,1,8] [--out DIR]

Paths: radix (and each --radix tiling); candidates (each scan tiling); candidates reading the sampled slots' keys
from their copy (`select_topk(samples=)`, what BinaryPC's scorers write beside the keys); the same with each --pick
block of the candidates' program; candidates at each --samples setting.

Keys: 64-bit codes of random correlated keys (8 KV heads, head_dim 128) against a fresh basis, scored by the table
kernel for 4 query heads a KV head with 7-bit probes (Llama-3.1-8B's heads); budget 2%, 4 sinks, window 64.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from sparsespec.kernels.binarypc import encode_slots, key_range, probe_tables, sampled_keys_ref, score_keys
from sparsespec.kernels.select import CANDIDATE_ROOM, same_selection, select_topk, takes_candidates
from sparsespec.sparse_bench import graphed, time_ms


def binarypc_keys(B: int, S: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Hkv, G, D, bits, m = 8, 4, 128, 64, 7
    basis = torch.randn(B, Hkv, bits, D, generator=g, device="cuda")
    codes = torch.zeros(B, Hkv, S, 1, dtype=torch.int64, device="cuda")
    for b in range(B):  # a row at a time: the fp32 keys of one row at 128k are 0.5 GB
        k = torch.randn(1, Hkv, S, D, generator=g, device="cuda") + torch.randn(1, Hkv, 1, D, generator=g,
                                                                                 device="cuda")
        start, end = torch.zeros(1, dtype=torch.int32, device="cuda"), torch.full((1,), S, dtype=torch.int32,
                                                                                    device="cuda")
        encode_slots(k, basis[b:b + 1], codes[b:b + 1], torch.zeros(1, Hkv, S, device="cuda"), start, end, S)
    positions = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
    _, tables = probe_tables(torch.randn(B, Hkv * G, D, generator=g, device="cuda"), basis, m)
    return score_keys(codes, tables, positions, m, bits, G), positions, key_range(bits, m)[1]


def kernel_times(fn, steps: int = 20) -> dict[str, float]:
    """Device time per call of each kernel fn launches (us), over `steps` calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            times[e.key] += e.device_time_total / steps
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x131072,4x131072,16x32768,16x131072")
    ap.add_argument("--budget", type=float, default=0.02)
    ap.add_argument("--scan", default="4x2048",
                    help="the candidate path's compaction tilings to time, WAVESxBLOCK comma-separated")
    ap.add_argument("--pick", default="",
                    help="more block sizes of the candidates' program to time beside the default's 2048 (a warp per "
                         "256 candidates; with the first scan tiling), comma-separated")
    ap.add_argument("--samples", default="",
                    help="more settings of the candidate path to time beside the default's 16/16/2 (with the first "
                         "scan tiling): sample stride / margin [/ room, in selection widths], comma-separated")
    ap.add_argument("--flat-rows", default="0",
                    help="how many rows get one key in every slot (the candidates overflow: those rows fall back to "
                         "the radix passes), comma-separated counts, each timed: what a fallback costs")
    ap.add_argument("--radix", default="",
                    help="more tilings of the radix path to time beside the default's 2048x4x8: slots a step x "
                         "programs per SM x warps a program, comma-separated")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    for shape, flat in ((s, int(f)) for s in args.shapes.split(",") for f in args.flat_rows.split(",")):
        B, S = map(int, shape.split("x"))
        keys, positions, key_bits = binarypc_keys(B, S)
        if flat:
            keys[:flat] = keys[:flat].max()  # a flat row: its sampled threshold takes every live slot
        tokens = torch.full((B,), int(S * args.budget), dtype=torch.int32, device="cuda")
        width = int(S * args.budget) + 68
        opts = dict(sinks=4, window=64)
        outs = {}
        row = {"batch": B, "context": S, "flat_rows": flat,
               "auto": "candidates" if takes_candidates(keys.shape[0], S, width, key_bits) else "radix"}
        paths = [("radix", dict(sampled=False))]
        for tiling in filter(None, args.radix.split(",")):
            blk, w, warps = map(int, tiling.split("x"))
            paths.append((f"radix {tiling}", dict(sampled=False, block=blk, waves=w, num_warps=warps)))
        for i, tiling in enumerate(args.scan.split(",")):
            w, blk = map(int, tiling.split("x"))
            paths.append(("candidates" + (f" {tiling}" if i else ""), dict(sampled=True, scan_waves=w,
                                                                            scan_block=blk)))
        # the sampled slots' keys read from the copy a scorer writes beside the keys (as the policy's step does)
        copy = sampled_keys_ref(keys).contiguous()
        first = next(kw for name, kw in paths if name == "candidates")
        paths.append(("candidates, sample copy", dict(first, samples=copy)))
        for pick in filter(None, args.pick.split(",")):
            paths.append((f"candidates, pick {pick}", dict(first, samples=copy, pick_block=int(pick))))
        for setting in filter(None, args.samples.split(",")):
            stride, margin, room = (list(map(int, setting.split("/"))) + [CANDIDATE_ROOM])[:3]
            paths.append((f"candidates {stride}/{margin}/{room}", dict(first, stride=stride, margin=margin,
                                                                       room=room)))
        for name, kw in paths:
            out = (torch.empty(keys.shape[0], width, dtype=torch.int32, device="cuda"),
                   torch.empty(keys.shape[0], dtype=torch.int32, device="cuda"))
            call = lambda: select_topk(keys, positions, tokens, positions + 1, width, key_bits,  # noqa: E731
                                       out=out, **kw, **opts)
            row[f"{name}_kernels_us"] = kernel_times(call)
            row[f"{name}_ms"] = time_ms(graphed(call))
            outs[name] = [t.clone() for t in out]
            served = torch.empty(keys.shape[0], dtype=torch.int32, device="cuda")  # (once more, untimed)
            select_topk(keys, positions, tokens, positions + 1, width, key_bits, out=out, served=served, **kw, **opts)
            row[f"{name}_served"] = int(served.sum())
        row["same"] = all(same_selection(outs["radix"], out) for out in outs.values())
        rows.append(row)
        print(f"{B} x {S}{f', {flat} flat rows' if flat else ''} (auto: {row['auto']}; same selection on every "
              f"path: {row['same']})")
        for name, _ in paths:
            print(f"   {name} {row[f'{name}_ms'] * 1e3:.1f} us, {row[f'{name}_served']} of {keys.shape[0]} rows by "
                  f"candidates: " + ", ".join(
                f"{k.split('_kernel')[0].lstrip('_')} {v:.1f}" for k, v in row[f"{name}_kernels_us"].items()
                if "elementwise" not in k))
        del keys
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "select_paths.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
