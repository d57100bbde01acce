"""Decode-step time on the GPU for a Llama-3.1-8B-shaped model (random bf16 weights) against the memory floor.

The floor is the bytes one step must read (every weight matrix, the B embedding rows, the whole KV cache in use)
divided by the device-to-device copy bandwidth measured in the same run. Steps are CUDA-graph replays.

    python bench/gpu_decode.py --out docs/results   (on the device machine: PYTHONPATH=. python3 ...)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sparsespec.cache import KVCache
from sparsespec.config import ModelConfig, RopeScaling
from sparsespec.graphs import CudaGraphDecodeStep
from sparsespec.models.rope import inverse_frequencies
from sparsespec.models.transformer import Transformer

LLAMA31_8B = ModelConfig(
    arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
    num_kv_heads=8, head_dim=128, max_position=131072, rms_eps=1e-5, rope_theta=500000.0,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
)


def random_model(cfg: ModelConfig, dtype=torch.bfloat16) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02)
    model.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).cuda()
    return model.eval()


def time_ms(fn, iters: int = 30, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls (CUDA events)."""
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


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), iters=10)
    return 2 * (4 << 30) / (ms / 1e3)


def step_bytes(model: Transformer, cfg: ModelConfig, batch: int, context: int) -> int:
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    embed_rows = batch * cfg.hidden_size * 2
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim * 2
    return weights + embed_rows + kv


VARIANTS = [("graph", False), ("compiled graph", True)]  # (name, torch.compile)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64  # one compilation per (variant, batch, context)
    bw = copy_bandwidth()
    device = torch.cuda.get_device_name()
    cfg = LLAMA31_8B
    model = random_model(cfg)
    rows = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            cache = KVCache(cfg, batch, context, torch.bfloat16, "cuda")
            for t in cache.k + cache.v:
                t.normal_()
            positions = torch.full((batch,), context - 1, device="cuda")  # attend to the full context
            tokens = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
            floor_ms = step_bytes(model, cfg, batch, context) / bw * 1e3
            row = {"batch": batch, "context": context, "floor_ms": floor_ms}
            reference = None
            for name, compiled in VARIANTS:
                start = time.perf_counter()
                step = CudaGraphDecodeStep(model, cache, compile=compiled)
                setup_s = time.perf_counter() - start
                ms = time_ms(lambda: step(tokens, positions))
                logits = step(tokens, positions).clone()
                reference = logits if reference is None else reference
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
             "| batch | context | floor ms | " + " | ".join(name for name, _ in VARIANTS) + " |",
             "|---:|---:|---:|" + "---:|" * len(VARIANTS)]
    for r in rows:
        cells = [f"{r[name]['ms']:.2f} ({100 * r[name]['floor_fraction']:.0f}%)" for name, _ in VARIANTS]
        lines.append(f"| {r['batch']} | {r['context']} | {r['floor_ms']:.2f} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        (Path(args.out) / "gpu_decode.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
