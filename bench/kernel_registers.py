"""The attention kernels (or the select's, `--select`) compiled for a Hopper GPU without one (CPU is enough): per
launch, the PTX instruction count, the `cp.async` copies (the select's: its key loads' width, its barriers), and
what `ptxas -v` reports — registers a thread, spills, and Triton's shared memory. A
static check before device time is spent: which launches spill, how many programs a multiprocessor can hold, and
whether two launches that time differently (e.g. the one-query block attention of query-head groups 4 and 6,
docs/results/sparse_gpu.md, forty-second session) compile to different code.

    python bench/kernel_registers.py [--groups 4,6] [--widths 1] [--keys 64,128] [--warps 4] [--stages 2,3]
    python bench/kernel_registers.py --select     (the select's passes over the keys: how wide their loads are)
    python bench/kernel_registers.py --scorers    (BinaryPC's table and dp4a scorers: SASS instructions a key;
                                                  its probes: SASS instructions a thread)

Kernels: `_block_partial_kernel` (dense decode steps and verify blocks: the rows of `block_tiles`' tile) and
`_partial_kernel` (the sparse flash-decoding over selected slots; width 1 only), head_dim 128, bf16, 8 KV heads. The
arguments carry the specialisation Triton gives them on the device (pointers and the strides of real shapes
divisible by 16; the positions' and counts' unit strides constant). Uses the `ptxas` that ships with Triton,
`ptxas-blackwell` where it is there (the newer build: the PTX version Triton emits may be newer than the default one
reads). The code is Triton's of this machine, which may differ from the device's version.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # (compile, not interpret)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sparsespec.kernels import attend  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
POINTERS = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "positions": "*i64", "tree": "*i64", "idx": "*i32",
            "count": "*i32", "m_part": "*fp32", "l_part": "*fp32", "acc_part": "*fp32"}
UNIT = ("stride_pb", "stride_tb", "stride_ch")  # strides of 1 in a decode step (T = 1): Triton makes them constants
SCALARS = ("qk_scale",)
SELECT_POINTERS = {"keys_ptr": "*i16", "cand_ptr": "*i16", "samples_ptr": "*i16", "attended_ptr": "*fp32",
                   "codes_ptr": "*i64", "tables_ptr": "*i64"}  # (others, positions included: int32, as a plan has)


def ptxas() -> str:
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    found = sorted(folder.glob("ptxas*"), key=lambda p: p.name != "ptxas-blackwell")  # (Triton's newer build first)
    if not found:
        raise SystemExit(f"no ptxas under {folder}")
    return str(found[0])


def compile_one(kernel, consts: dict, warps: int, stages: int, width: int = 1) -> dict:
    consts = {"PDL": True} | consts  # (chained kernels wait on their predecessor first: kernels/launch.py)
    names = kernel.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
        elif name in UNIT and (width == 1 or name == "stride_ch"):
            signature[name], constexprs[(i,)] = "constexpr", 1
        elif name in SCALARS:
            signature[name] = "fp32"
        else:  # pointers, and the strides, chunk and counts of real shapes: multiples of 16 (a block's positions'
            signature[name] = POINTERS.get(name, "i32")  # stride, T, only when T is)
            if name != "PARTS" and (name not in UNIT or width % 16 == 0):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return compiled(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), warps, stages)


def compile_select(kernel, consts: dict, warps: int, sass: bool = False) -> dict:
    """A kernel of the select (`kernels/select.py`) for BinaryPC's 14-bit int16 keys: pointers 16-aligned, the sizes
    that real shapes make multiples of 16 (S, R, C, NS) marked so, as Triton specialises them on the device."""
    consts = {"PDL": True} | consts
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name], constexprs[(i,)] = "constexpr", consts[name]
        elif name.endswith("_ptr"):
            signature[name] = SELECT_POINTERS.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name in ("S", "R", "C", "NS"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return compiled(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs), warps, 3, sass)


def compiled(src, warps: int, stages: int, sass: bool = False) -> dict:
    out = triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages})
    ptx = out.asm["ptx"]
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernel_registers_{os.getpid()}.ptx"
    cubin = path.with_suffix(".cubin")
    path.write_text(ptx)
    report = subprocess.run([ptxas(), "-arch=sm_90a", "-v", str(path), "-o", str(cubin) if sass else os.devnull],
                            capture_output=True, text=True)
    path.unlink()
    ops = sass_ops(cubin) if sass else {}
    regs = spills = None
    for line in report.stderr.splitlines():
        if "Used" in line and "registers" in line:
            regs = int(line.split("Used")[1].split("registers")[0])
        if "spill stores" in line:
            spills = int(line.split("bytes spill stores")[0].split(",")[-1])
    if regs is None:
        raise SystemExit(f"ptxas said: {report.stderr.strip()[:400]}")
    lines = [line.strip() for line in ptx.splitlines() if line.startswith("\t")]
    body = [line.split()[1] if line.startswith("@") else line.split()[0]  # (predicated: "@%p1 ld.global...")
            for line in lines if line[:1].isalpha() or line.startswith("@")]
    return {"instructions": len(body), "cp_async": sum(op.startswith("cp.async.cg") for op in body),
            "registers": regs, "spill_bytes": spills, "shared_bytes": out.metadata.shared,
            "scalar_16bit_loads": sum(op == "ld.global.b16" for op in body),
            "vector_loads": sum(op.startswith("ld.global.v") for op in body),
            "barriers": sum(op.startswith("bar.sync") for op in body), "sass": ops}


def sass_ops(cubin: Path) -> dict[str, int]:
    """SASS opcode -> how many in the compiled kernel (nvdisasm, shipped with Triton); the cubin is removed."""
    listing = subprocess.run([str(Path(ptxas()).parent / "nvdisasm"), "-c", str(cubin)], capture_output=True,
                             text=True).stdout
    cubin.unlink()
    ops: dict[str, int] = {}
    for line in listing.splitlines():
        code = line.strip().split("*/", 1)[1].strip() if line.strip().startswith("/*") and "*/" in line else ""
        words = code.split()[1:] if code.startswith("@") else code.split()  # (predicated: "@P0 LDG...")
        if words:
            ops[words[0].rstrip(";")] = ops.get(words[0].rstrip(";"), 0) + 1
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="4,6", help="query heads a KV head")
    ap.add_argument("--widths", default="1", help="queries a row (block attention; the sparse kernel: 1 only)")
    ap.add_argument("--keys", default="64,128")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--select", action="store_true",
                    help="the select's passes over the keys instead (BinaryPC's 14-bit keys, 2,048-slot blocks)")
    ap.add_argument("--scorers", action="store_true",
                    help="BinaryPC's two scorers instead (64-bit codes, 4 query heads a KV head, 7-bit probes)")
    args = ap.parse_args()
    if args.select:
        return select_table()
    if args.scorers:
        return scorer_table()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    print("| kernel | group | width | rows | keys | warps | stages | PTX instructions | cp.async | registers "
          "| spill bytes | shared bytes |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for G in ints(args.groups):
        for T in ints(args.widths):
            rows = attend.block_tiles(G, T, 128, torch.bfloat16, False).rows  # (the default's tile, capped)
            for keys in ints(args.keys):
                for warps in ints(args.warps):
                    for stages in ints(args.stages):
                        runs = [("block", attend._block_partial_kernel,
                                 dict(HKV=8, G=G, T=T, D=128, BLOCK_R=rows, BLOCK_N=keys, DOT=tl.bfloat16,
                                      TREE=False, WINDOW=False))]
                        if T == 1:
                            runs.append(("sparse decode", attend._partial_kernel,
                                         dict(HKV=8, G=G, D=128, BLOCK_G=max(16, triton.next_power_of_2(G)),
                                              BLOCK_N=keys, DOT=tl.bfloat16)))
                        for name, kernel, consts in runs:
                            r = compile_one(kernel, consts, warps, stages, T)
                            print(f"| {name} | {G} | {T} | {consts.get('BLOCK_R', consts.get('BLOCK_G'))} | {keys} "
                                  f"| {warps} | {stages} | {r['instructions']} | {r['cp_async']} "
                                  f"| {r['registers']} | {r['spill_bytes']} | {r['shared_bytes']} |")


def select_table() -> None:
    """The select's passes over the keys as the candidate and radix paths launch them at 8 KV heads (5 programs a
    row): the key loads' width (a masked load vectorises only where Triton can prove the mask uniform over a run of
    lanes), barriers, registers."""
    from sparsespec.kernels import select

    keys = dict(HKV=8, KEY_BITS=14, BLOCK=2048)
    runs = [("sample", select._sample_kernel, dict(HKV=8, KEY_BITS=14, STRIDE=16, BLOCK=8192, RESIDENT=True,
                                                    SAMPLES=True), 8),
            ("compact", select._compact_kernel, keys, 8),
            ("place", select._place_kernel, dict(HKV=8, KEY_BITS=14, PP=8, BLOCK=1024), 4),
            ("candidates", select._candidates_kernel, dict(HKV=8, KEY_BITS=14, PP=8, BLOCK=2048, CBLOCK=8192,
                                                           RESIDENT=True, ATTENDED=True), 8),
            ("histogram, top digit", select._histogram_kernel, dict(keys, LAST=6, D=0, P=5, SKIP=False), 8),
            ("histogram, last digit", select._histogram_kernel, dict(keys, LAST=6, D=1, P=5, SKIP=False), 8),
            ("write", select._write_kernel, dict(keys, LAST=6, P=5, PP=8, ATTENDED=True, SKIP=False), 8)]
    print("| kernel | PTX instructions | 16-bit scalar loads | vector loads | barriers | registers | shared bytes |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for name, kernel, consts, warps in runs:
        r = compile_select(kernel, consts, warps)
        print(f"| {name} | {r['instructions']} | {r['scalar_16bit_loads']} | {r['vector_loads']} | {r['barriers']} "
              f"| {r['registers']} | {r['shared_bytes']} |")


def scorer_table() -> None:
    """BinaryPC's scorers over one program's slots (Llama-3.1-8B's heads: 4 query heads a KV head, 64-bit codes,
    7-bit probes), with and without the copy of the sampled slots' keys (`samples=`), per key: SASS instructions,
    shared-memory loads (the table scorer's lookups), dp4a, barriers — a static account of what each spends a key,
    not a time."""
    from sparsespec.kernels import binarypc

    lay = binarypc.TableLayout.of(4, 64, 7)
    table = dict(HKV=8, G=4, W=1, WP=1, NB=lay.nb, LANES=lay.lanes, LANE_BITS=lay.lane_bits, T=lay.tables,
                 BIAS=lay.bias)
    packed = dict(HKV=8, G=4, W=1, ASM=True, STRIDE=16, EXTRA=True, EBLOCK=256)
    table |= dict(EXTRA=True, EBLOCK=256)  # (the safeguard's forced list written with the keys, as the policy does)
    runs = [("table", binarypc._score_kernel, dict(table, BLOCK=1024, STRIDE=16, SAMPLES=copy), 4) for copy in (0, 1)]
    runs += [("dp4a", binarypc._score_dp4a_kernel, dict(packed, BLOCK=block, SAMPLES=copy), warps)
             for block, warps in ((1024, 4), (512, 4), (2048, 8)) for copy in (0, 1)]
    print("| scorer | slots | warps | sample copy | registers | shared bytes | SASS a key | shared loads a key "
          "| dp4a a key | barriers a program |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, kernel, consts, warps in runs:
        r = compile_select(kernel, consts, warps, sass=True)
        per = consts["BLOCK"] / (32 * warps)  # keys a thread
        ops = r["sass"]
        lds = sum(n for op, n in ops.items() if op.startswith("LDS"))
        dp4a = sum(n for op, n in ops.items() if op.startswith("IDP"))
        bars = sum(n for op, n in ops.items() if op.startswith("BAR"))
        print(f"| {name} | {consts['BLOCK']} | {warps} | {'yes' if consts['SAMPLES'] else 'no'} | {r['registers']} "
              f"| {r['shared_bytes']} "
              f"| {sum(ops.values()) / per:.0f} | {lds / per:.1f} | {dp4a / per:.0f} | {bars} |")
    # the probes: one program a (row, KV head), so at batch 1 a launch takes one program's latency
    SELECT_POINTERS.update(q_ptr="*bf16", basis_ptr="*fp32")
    probes = [("packed", binarypc._probe_packed_kernel, dict(G=4, GP=4, D=128, BITS=64, W=1, M=7), w)
              for w in (4, 8, 16)]
    probes.append(("tables, a byte a program", binarypc._probe_kernel, dict(
        G=4, D=128, BITS=64, W=1, M=7, NB=lay.nb, LANES=lay.lanes, LANE_BITS=lay.lane_bits, T=lay.tables,
        BIAS=lay.bias, BYTES=1), 4))
    print("\n| probe | warps | registers | SASS a thread | shuffles | barriers |\n|---|---:|---:|---:|---:|---:|")
    for name, kernel, consts, warps in probes:
        r = compile_select(kernel, consts, warps, sass=True)
        ops = r["sass"]
        print(f"| {name} | {warps} | {r['registers']} | {sum(ops.values())} | {ops.get('SHFL.BFLY', 0)} "
              f"| {sum(n for op, n in ops.items() if op.startswith('BAR'))} |")


if __name__ == "__main__":
    main()
