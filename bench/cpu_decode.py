"""CPU decode speed of a real model: ours vs HF transformers `generate`, same prompt, same process.

Both decode greedily from a prompt of real text (Wikipedia leads) at each context length; we time only the decode
steps (ours: after the first token; HF: generate(N) minus generate(1), which removes its prefill).

    python bench/cpu_decode.py [--model smollm2-135m] [--contexts 1024,4096] [--new-tokens 32] [--out docs/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from sparsespec import corpora  # noqa: E402
from sparsespec.generate import Engine, GenerationConfig  # noqa: E402
from sparsespec.models.loading import load  # noqa: E402
from sparsespec.models.registry import resolve  # noqa: E402


def hf_decode_tokens_per_s(hf, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])

    def run(n):
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    run(2)  # warm-up
    return (new_tokens - 1) / (run(new_tokens) - run(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = resolve(args.model)
    engine = Engine(load(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    text = corpora.text("wiki", 12000, seed=7)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, stop_on_eos=False)
    rows = []
    for context in map(int, args.contexts.split(",")):
        prompt = engine.tokenizer(text)["input_ids"][:context]
        engine.generate([prompt[:64]], GenerationConfig(max_new_tokens=4))  # warm-up
        ours = engine.generate([prompt], gen)
        theirs = hf_decode_tokens_per_s(hf, prompt, args.new_tokens)
        rows.append({"context": context, "ours_tok_s": ours.decode_tokens_per_s, "hf_tok_s": theirs,
                     "ratio": ours.decode_tokens_per_s / theirs, "ours_ttft_s": ours.ttft_s})
        print(json.dumps(rows[-1]), flush=True)
    import transformers

    head = (f"CPU decode, {args.model} (real weights, fp32), {args.new_tokens} new tokens, greedy; "
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, transformers {transformers.__version__}")
    lines = [head, "", "| context | ours tok/s | HF generate tok/s | ours / HF | ours TTFT s |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['context']} | {r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['ratio']:.2f} | "
              f"{r['ours_ttft_s']:.2f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cpu_decode.md").write_text(table + "\n")
        (Path(args.out) / "cpu_decode.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
