"""τ of `--draft ngram+dflash` (`LookupFirst`) over its two settings: the shortest recurring n-gram a copy needs
(min_n) and the fewest tokens a copy must propose (min_tokens), greedy, on HumanEval problems.

    python bench/lookup_first_sweep.py --settings 4,4 3,2 2,1 6,8 --prompts 16 --max-new-tokens 128

Real weights (`--model`, default qwen2.5-coder-0.5b, its shipped DFlash drafter), fp32 on the CPU unless
`--device cuda`; batches of 8. Prints one line a setting: τ (committed tokens / verify steps) and the seconds taken.
"""

from __future__ import annotations

import argparse
import time

import torch

from sparsespec.generate import Engine, GenerationConfig
from sparsespec.models.loading import DTYPES
from sparsespec.spec.decode import speculative_generate
from sparsespec.spec.dflash import DFlash, DFlashDrafter
from sparsespec.spec.drafters import LookupFirst
from sparsespec.spec.prompts import make_prompts
from sparsespec.spec.registry import drafter_path


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="+", default=["4,4"], help="min_n,min_tokens pairs")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    engine = Engine.from_name(args.model, device=args.device, dtype=args.dtype)
    model = DFlash.load(drafter_path(args.model), engine.device, DTYPES[args.dtype])
    prompts = [engine.encode(p.text, chat=True) for p in make_prompts(args.prompts, "heldout", ("humaneval",), 0, 0)]
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    for setting in args.settings:
        min_n, min_tokens = map(int, setting.split(","))
        start, tokens, steps = time.time(), 0, 0
        for i in range(0, len(prompts), args.batch):
            drafter = LookupFirst(DFlashDrafter(model, engine.model), min_n=min_n, min_tokens=min_tokens)
            for out in speculative_generate(engine, prompts[i:i + args.batch], drafter, gen, 16):
                tokens, steps = tokens + sum(out.committed), steps + out.steps
        print(f"min_n={min_n} min_tokens={min_tokens}: tau {tokens / steps:.2f} ({time.time() - start:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
