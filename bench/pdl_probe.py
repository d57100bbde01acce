"""Does programmatic dependent launch (PDL) shorten a CUDA graph of small dependent Triton kernels on this GPU?

A chain of N kernels, each reading the previous one's output (a true dependency), captured in one CUDA graph and
replayed; per-kernel time with plain launches, with PDL (each kernel waits on its predecessor's grid with
`griddepcontrol.wait` before reading), and with PDL whose kernels also signal their dependents at their start.
The sizes are those of a sparse decode layer at batch 1 (tens to a thousand programs, a few microseconds each).

    python3 bench/pdl_probe.py [--kernels 32] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _step_kernel(x, y, n, WAIT: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    if WAIT:
        tl.extra.cuda.gdc_wait()
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + offs, mask=offs < n, other=0.0)
    tl.store(y + offs, v * 1.0001 + 1.0, mask=offs < n)


def chain(bufs, n, block, wait, early, pdl):
    grid = (triton.cdiv(n, block),)
    for i in range(len(bufs) - 1):
        _step_kernel[grid](bufs[i], bufs[i + 1], n, WAIT=wait, EARLY=early, BLOCK=block, num_warps=4,
                           launch_pdl=pdl)


def time_graph(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=32)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    print(f"{'programs':>8} {'bytes/kernel':>12} {'plain us':>9} {'pdl us':>8} {'pdl+early us':>12}  (per kernel)")
    for programs, block in ((8, 1024), (64, 1024), (512, 1024), (1024, 4096)):
        n = programs * block
        bufs = [torch.randn(n, device="cuda") for _ in range(args.kernels + 1)]
        row = {"programs": programs, "bytes": n * 8,
               "plain": time_graph(lambda: chain(bufs, n, block, False, False, False)) * 1e3 / args.kernels}
        ref = bufs[-1].clone()  # the plain chain's output: each PDL mode must reproduce it
        for name, early in (("pdl", False), ("pdl_early", True)):
            row[name] = time_graph(lambda: chain(bufs, n, block, True, early, True)) * 1e3 / args.kernels
            row[name + "_equal"] = bool(torch.equal(bufs[-1], ref))
        rows.append(row)
        print(f"{programs:>8} {n * 8:>12} {row['plain']:>9.2f} {row['pdl']:>8.2f} {row['pdl_early']:>12.2f}"
              f"  equal: {row['pdl_equal']} {row['pdl_early_equal']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
