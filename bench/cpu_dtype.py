"""Which compute dtype on the CPU: greedy agreement with fp32 and decode speed of fp32 / bf16 / fp16, real weights.

Each prompt (real text: Wikipedia, Shakespeare, KJV and standard-library code, cut to a few hundred tokens) is
decoded greedily in every dtype; agreement = the share of generated tokens before the first one that differs from
fp32's, and the share of prompts whose whole output equals fp32's.

    python bench/cpu_dtype.py [--model smollm2-135m] [--prompts 6] [--new-tokens 48] [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from sparsespec import corpora  # noqa: E402
from sparsespec.generate import Engine, GenerationConfig  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def prompts(engine: Engine, n: int, tokens: int) -> list[list[int]]:
    kinds = ("wiki", "shakespeare", "kjv", "stdlib")
    out = []
    for i in range(n):
        ids = engine.tokenizer(corpora.text(kinds[i % len(kinds)], tokens, seed=i))["input_ids"]
        out.append(ids[:tokens])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = GenerationConfig(max_new_tokens=args.new_tokens, stop_on_eos=False)
    outputs, speed = {}, {}
    for dtype in DTYPES:
        engine = Engine.from_name(args.model, dtype=dtype)
        ps = prompts(engine, args.prompts, args.prompt_tokens)
        engine.generate([ps[0]], GenerationConfig(max_new_tokens=4))  # warm-up
        runs = [engine.generate([p], gen) for p in ps]
        outputs[dtype] = [r.token_ids[0] for r in runs]
        speed[dtype] = sum(r.decode_tokens_per_s for r in runs) / len(runs)
        print(dtype, f"{speed[dtype]:.1f} tok/s", flush=True)
    rows = []
    for dtype in DTYPES:
        prefix = [next((i for i, (a, b) in enumerate(zip(o, ref)) if a != b), len(ref)) / len(ref)
                  for o, ref in zip(outputs[dtype], outputs["float32"])]
        same = sum(o == ref for o, ref in zip(outputs[dtype], outputs["float32"])) / len(prefix)
        rows.append({"dtype": dtype, "decode_tokens_per_s": speed[dtype], "agree_prefix": sum(prefix) / len(prefix),
                     "identical_outputs": same})
    lines = [f"CPU decode by compute dtype, {args.model} (real weights), {args.prompts} real-text prompts of "
             f"{args.prompt_tokens} tokens, {args.new_tokens} greedy tokens; {platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}", "",
             "| dtype | decode tok/s | vs fp32 | tokens before the first difference from fp32 "
             "| outputs equal to fp32 |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r['decode_tokens_per_s'] / speed['float32']:.2f}x | {100 * r['agree_prefix']:.0f}% | "
                     f"{100 * r['identical_outputs']:.0f}% |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_dtype.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / "cpu_dtype.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
