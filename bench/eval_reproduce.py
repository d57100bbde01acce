"""Stored accuracy rows through the fixed-width sparse path: the same samples, the same greedy outputs and scores?

Rebuilds samples of a stored `sparsespec eval` folder (same task, length and seed), checks each prompt has the stored
token count, prefills once per sample, then decodes every policy through the runner's fixed-width path (the path
CUDA graphs capture; on CPU the kernels' torch references) and compares output text and score with the stored row.
The stored rows predate the token floor, so `min_tokens=0` is added to every sparse policy (the old default).

    python bench/eval_reproduce.py --results docs/results/eval-qwen05/results.jsonl --model qwen2.5-coder-0.5b \
        --length 4096 --tasks niah_single,niah_multikey,vt,qa --samples 0,1 --out docs/results/eval-reproduce
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from sparsespec.attention import make_policy, parse_spec  # noqa: E402
from sparsespec.eval.tasks import TaskBuilder, score  # noqa: E402
from sparsespec.generate import Engine  # noqa: E402
from sparsespec.progress import progress_bar  # noqa: E402
from sparsespec.runner import Runner  # noqa: E402

POLICIES = ("dense", "binarypc:budget=0.02,sinks=4", "topk:budget=0.02", "quest:budget=0.02",
            "streaming:budget=0.02")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--tasks", default="niah_single,niah_multikey,vt,qa")
    ap.add_argument("--samples", default="0,1")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    stored = {(r["task"], r["length"], r["policy"], r["sample"]): r
              for r in map(json.loads, Path(args.results).read_text().splitlines())}
    engine = Engine.from_name(args.model)
    builder = TaskBuilder(engine.tokenizer)
    todo = [(t, int(i)) for t in args.tasks.split(",") for i in args.samples.split(",")]
    rows = []
    with progress_bar() as bar, torch.inference_mode():
        job = bar.add_task("reproduce", total=len(todo) * len(args.policies))
        for task, i in todo:
            sample = builder.sample(task, args.length, args.seed + i)
            prompt = engine.tokenizer(sample.prompt)["input_ids"]
            runner = Runner(engine.model, 1, len(prompt) + sample.max_new_tokens, fixed=True)
            first = engine.model.logits(runner.prefill([prompt]))
            for spec in args.policies:
                old = stored.get((task, args.length, spec, i))
                name, opts = parse_spec(spec)
                runner.truncate([len(prompt)])
                runner.use(None if name == "dense" else make_policy(name, [*opts, "min_tokens=0"]))
                token, out = first.argmax(-1), []
                while True:
                    out.append(int(token))
                    if out[-1] in engine.eos_ids or len(out) == sample.max_new_tokens:
                        break
                    token = runner.decode(token).argmax(-1)
                text = engine.tokenizer.decode(out, skip_special_tokens=True)
                rows.append({"task": task, "sample": i, "policy": spec, "prompt_tokens": len(prompt),
                             "stored_prompt_tokens": old and old["prompt_tokens"],
                             "stored_score": old and old["score"], "score": score(text, sample.answers),
                             "same_output": old is not None and old["output"] == text, "output": text})
                bar.advance(job)
    lines = [f"Stored rows of {args.results} ({args.model}, {args.length} tokens) through the fixed-width path "
             f"(CPU, fp32, batch 1)", "", "| task | sample | policy | stored score | score | same output |",
             "|---|---:|---|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['sample']} | {r['policy']} | {r['stored_score']} | {r['score']} | "
                     f"{'yes' if r['same_output'] else 'no'} |")
    same = sum(r["same_output"] for r in rows)
    scores = sum(r["score"] == r["stored_score"] for r in rows)
    lines += ["", f"{same} of {len(rows)} outputs identical to the stored ones; {scores} of {len(rows)} scores equal; "
                  f"prompts of the stored length: {sum(r['prompt_tokens'] == r['stored_prompt_tokens'] for r in rows)}"
                  f" of {len(rows)}."]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (Path(args.out) / "reproduce.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
