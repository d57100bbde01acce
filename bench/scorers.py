"""BinaryPC's two GPU scorers side by side (CUDA): the byte-table scorer (`probe_tables` + `score_keys`: eight
shared-memory lookups a key) and the dp4a scorer (`probe_packed` + `score_keys_dp4a`: sixteen dp4a a key and query
head, in registers), each stage replayed as a CUDA graph, the dp4a scorer over several tilings, with the bytes floor
(the codes read and the keys written, at the measured copy bandwidth). Checks first that both give the same keys.

    python3 bench/scorers.py --shapes 1x131072,4x131072,16x32768,16x131072 [--tilings 1024x4,512x4,2048x8]
        [--copy no] [--out DIR]

Codes: random 64-bit words (the scorers' time does not depend on their values), 8 KV heads, 4 query heads a KV head,
head_dim 128, 7-bit probes: Llama-3.1-8B's heads, as `sparsespec bench attention` times them; where the select
takes its candidate path (2% of 4 x 128k, 16 x 32k, 16 x 128k) the scorers also copy the sampled slots' keys, as
the policy's step has them do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from sparsespec.kernels.binarypc import (byte_tables, key_range, probe_packed, probe_tables, sample_copy, score_keys,
                                         score_keys_dp4a)
from sparsespec.kernels.select import takes_candidates
from sparsespec.sparse_bench import copy_bandwidth, graphed, time_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1x131072,4x131072,16x32768,16x131072")
    ap.add_argument("--tilings", default="1024x4,512x4,2048x8,1024x8,256x4",
                    help="the dp4a scorer's slots and warps a program, BLOCKxWARPS comma-separated (the first is "
                         "`score_keys_dp4a`'s default)")
    ap.add_argument("--copy", choices=("auto", "no"), default="auto",
                    help="auto: copy the sampled slots' keys where the select samples them (as the policy does); no: "
                         "never (what the copy costs the scorers)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    Hkv, G, D, bits, m = 8, 4, 128, 64, 7
    bandwidth = copy_bandwidth()
    rows = []
    print("| batch x context | table probe | table score | tables | packed probe | dp4a score (tiling) | dp4a "
          "| speedup | floor |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        B, S = map(int, shape.split("x"))
        g = torch.Generator(device="cuda").manual_seed(B * S)
        codes = torch.randint(-(1 << 63), (1 << 63) - 1, (B, Hkv, S, 1), generator=g, device="cuda")
        basis = torch.randn(B, Hkv, bits, D, generator=g, device="cuda")
        q = torch.randn(B, Hkv * G, D, generator=g, device="cuda", dtype=torch.bfloat16)
        positions = torch.full((B,), S - 1, dtype=torch.int32, device="cuda")
        probe, tables = probe_tables(q, basis, m)
        packed_probe, packed, sums = probe_packed(q, basis, m)
        keys = score_keys(codes, tables, positions, m, bits, G)
        own = score_keys(codes, byte_tables(packed_probe, m), positions, m, bits, G)  # the table scorer's keys of
        # the dp4a probe (the two probe kernels may round a level on a boundary apart: counted below)
        out = torch.empty_like(keys)
        # the sampled slots' keys copied beside them where the select samples them, as the policy's step does
        width = int(S * 0.02) + 68  # a 2% plan's width: the budget, 4 sinks and a 64-slot window beside it
        key_bits = key_range(bits, m)[1]
        samples = (sample_copy(B * Hkv, S, key_bits, "cuda")
                   if args.copy == "auto" and takes_candidates(B * Hkv, S, width, key_bits) else None)
        times = {"table probe": time_ms(graphed(lambda: probe_tables(q, basis, m))),
                 "table score": time_ms(graphed(lambda: score_keys(codes, tables, positions, m, bits, G, out=out,
                                                                   samples=samples))),
                 "packed probe": time_ms(graphed(lambda: probe_packed(q, basis, m)))}
        equal = {}
        for tiling in args.tilings.split(","):
            block, warps = map(int, tiling.split("x"))
            run = graphed(lambda: score_keys_dp4a(codes, packed, sums, positions, m, bits, out=out, block=block,
                                                  num_warps=warps, samples=samples))
            run()
            torch.cuda.synchronize()
            equal[tiling] = torch.equal(out, own)  # the dp4a keys: those of the table scorer for the same probe
            times[f"dp4a score {tiling}"] = time_ms(run)
        if not all(equal.values()):
            raise SystemExit(f"{shape}: the dp4a keys differ from the table scorer's: {equal}")
        best = min(args.tilings.split(","), key=lambda t: times[f"dp4a score {t}"])
        tables_ms = times["table probe"] + times["table score"]
        dp4a_ms = times["packed probe"] + times[f"dp4a score {best}"]
        floor_ms = (codes.numel() * 8 + keys.numel() * keys.element_size()) / bandwidth * 1e3
        rows.append({"shape": shape, **times, "samples copied": samples is not None, "best tiling": best,
                     "floor": floor_ms, "equal keys": equal,
                     "probe levels that differ": int((probe != packed_probe).sum())})
        us = lambda ms: f"{ms * 1e3:.1f}"  # noqa: E731
        print(f"| {shape} | {us(times['table probe'])} | {us(times['table score'])} | {us(tables_ms)} "
              f"| {us(times['packed probe'])} | {us(times[f'dp4a score {best}'])} ({best}) | {us(dp4a_ms)} "
              f"| {tables_ms / dp4a_ms:.2f}x | {us(floor_ms)} |", flush=True)
    print("(us; each stage a CUDA graph replayed; floor: the codes read and the keys written at the copy bandwidth)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "scorers.json" if args.copy == "auto" else "scorers_no_copy.json"
        (args.out / name).write_text(json.dumps({"device": torch.cuda.get_device_name(), "bandwidth": bandwidth,
                                                 "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
