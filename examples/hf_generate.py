"""sparsespec from Hugging Face transformers: sparse attention and speculative decoding through `model.generate`.

    .venv/bin/python examples/hf_generate.py                                  # smollm2-135m, BinaryPC at 2%, n-gram
    .venv/bin/python examples/hf_generate.py --policy quest --budget 0.05 --drafter dflash \
        --model qwen2.5-coder-0.5b --device cuda

Loads a packaged model (a GGUF file) with transformers itself, then generates three times from one long prompt:
plain greedy (sdpa), sparse decode (attn_implementation="sparsespec_<policy>" + a SparseCache) and speculative
greedy (generate(custom_generate=speculative_generate, drafter=...)), which must equal plain greedy.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import sparsespec.hf as hf  # noqa: E402  (registers the sparsespec_<policy> attention implementations)
from sparsespec import corpora  # noqa: E402
from sparsespec.attention import POLICIES, parse_options  # noqa: E402
from sparsespec.attention.policy import SelectionOptions  # noqa: E402
from sparsespec.models.registry import resolve  # noqa: E402
from sparsespec.spec.drafters import NgramDrafter  # noqa: E402
from sparsespec.spec.registry import drafter_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a packaged model name or a GGUF file")
    ap.add_argument("--policy", default="binarypc", choices=list(POLICIES))
    ap.add_argument("--budget", type=float, default=0.02, help="keys attended per step (a share if <= 1; the budget policies)")
    ap.add_argument("--min-tokens", type=int, default=0, help="the policy's token floor (its default is 256)")
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "dflash"],
                    help="dflash: the drafter shipped for --model")
    ap.add_argument("--words", type=int, default=1500, help="words of real text in the prompt")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    path = resolve(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = model.to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = corpora.text("wiki", args.words, seed=3) + "\n\nQuestion: which topics does the text above cover?\nAnswer:"
    ids = tokenizer(text, return_tensors="pt").input_ids.to(args.device)
    new = args.max_new_tokens
    print(f"{args.model}: {ids.shape[1]} prompt tokens, {new} new tokens, {args.device}")

    def run(label: str, **kwargs) -> torch.Tensor:
        start = time.perf_counter()
        out = model.generate(ids, do_sample=False, max_new_tokens=new, **kwargs)[0, ids.shape[1]:]
        print(f"\n[{label}] {time.perf_counter() - start:.2f} s\n{tokenizer.decode(out, skip_special_tokens=True)!r}")
        return out

    plain = run("sdpa, plain greedy")

    model.set_attn_implementation(f"sparsespec_{args.policy}")
    cls = POLICIES[args.policy].Options
    budgeted = issubclass(cls, SelectionOptions)  # (dense and the top-p policies take no budget)
    options = parse_options(cls, {"budget": args.budget, "min_tokens": args.min_tokens} if budgeted else {})
    cache = hf.SparseCache(model.config, ids.shape[1] + new, options)
    sparse = run(f"sparsespec_{args.policy}" + (f", {options.budget:g} budget" if budgeted else ""), cache=cache)
    n = min(len(sparse), len(plain))
    attended = "all" if cache.mean_attended is None else f"{cache.mean_attended:.1f}"  # dense counts none
    same = int((sparse[:n] == plain[:n]).cumprod(0).sum())
    print(f"keys attended per step and KV head: {attended} of ~{ids.shape[1] + new // 2}; " + (
        f"the same {len(plain)} new tokens as sdpa" if torch.equal(sparse, plain) else
        f"{same} leading tokens of {len(plain)} equal to sdpa's"))

    model.set_attn_implementation("sdpa")
    drafter = NgramDrafter() if args.drafter == "ngram" else hf.dflash_drafter(model, drafter_path(args.model))
    spec = run(f"speculative greedy, {args.drafter}", custom_generate=hf.speculative_generate, drafter=drafter)
    print(f"speculative output equals plain greedy: {torch.equal(spec, plain)}")


if __name__ == "__main__":
    main()
