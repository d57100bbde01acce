"""`sparsespec eval`: long-context accuracy of every attention policy on RULER-style tasks, and perplexity.

For each (length, task, sample) the prompt is prefilled once, densely; each policy then builds its index from that
cache and decodes greedily, and the cache is rolled back to the prompt (`cache.truncate`) before the next policy:
adding a policy costs only its decode. Rows go to `results.jsonl` as they come; a rerun skips the rows already
there. Perplexity: the text's first `prefix` tokens are prefilled densely, every later token is predicted by a
teacher-forced decode step through the policy (so every prediction uses its sparse attention).
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import corpora
from ..attention import make_policy, parse_spec
from ..attention.policy import Policy
from ..cache import KVCache
from ..errors import SparseSpecError
from ..generate import Engine, build_policy, decode_step, prefill
from ..progress import progress_bar
from .tasks import TASKS, TaskBuilder, score


def parse_length(text: str) -> int:
    """"4k" -> 4096, "8192" -> 8192."""
    m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if not m or int(m.group(1)) == 0:
        raise SparseSpecError(f"invalid length {text!r} (use e.g. 4k or 4096)")
    return int(m.group(1)) * (1024 if m.group(2) else 1)


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[str, ...] = TASKS
    lengths: tuple[int, ...] = (4096,)
    samples: int = 20
    policies: tuple[str, ...] = ("dense",)  # specs: "name" or "name:key=value,..."
    options: tuple[str, ...] = ()  # "key=value" for every policy, "policy.key=value" for one
    seed: int = 0
    perplexity_tokens: int = 0  # tokens of real text scored per length (0: no perplexity)

    def __post_init__(self):
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise SparseSpecError(f"unknown task {sorted(unknown)[0]!r} (choose from {', '.join(TASKS)})")
        if self.samples < 1:
            raise SparseSpecError(f"samples must be >= 1, got {self.samples}")
        for spec in self.policies:
            self.policy(spec)  # validate names and options before any long work

    def policy(self, spec: str) -> Policy | None:
        """A fresh policy for `spec` (None for dense: the engine's own dense path)."""
        name, inline = parse_spec(spec)
        opts = {}
        for pair in (*self.options, *inline):
            key, _, value = pair.partition("=")
            owner, _, bare = key.rpartition(".")
            if not owner or owner == name:
                opts[bare] = value
        policy = make_policy(name, opts)
        return None if name == "dense" else policy


def _done(path: Path) -> set[tuple]:
    if not path.is_file():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            keys.add((r["task"], r["length"], r["policy"], r["sample"]))
    return keys


@torch.inference_mode()
def _greedy(engine: Engine, cache: KVCache, first_logits: torch.Tensor, policy: Policy | None,
            max_new: int) -> list[int]:
    tokens = first_logits.argmax(-1)  # [1]
    out = []
    for _ in range(max_new):
        out.append(int(tokens))
        if out[-1] in engine.eos_ids or len(out) == max_new:
            break
        tokens = decode_step(engine.model, cache, tokens, policy=policy).argmax(-1)
    return out


@torch.inference_mode()
def run_eval(engine: Engine, cfg: EvalConfig, out: Path, progress: bool = False) -> list[dict]:
    """Run every missing (task, length, sample, policy) row, appending to out/results.jsonl; return all rows."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = _done(results)
    builder = TaskBuilder(engine.tokenizer)
    jobs = [(length, task, i) for length in cfg.lengths for task in cfg.tasks for i in range(cfg.samples)]
    todo = [j for j in jobs if any((j[1], j[0], p, j[2]) not in done for p in cfg.policies)]
    with progress_bar() as bar, open(results, "a") as sink:
        task_id = bar.add_task("eval", total=len(todo) * len(cfg.policies), visible=progress)
        for length, task, i in todo:
            sample = builder.sample(task, length, cfg.seed + i)
            ids = engine.tokenizer(sample.prompt)["input_ids"]
            engine.check_fits(len(ids), sample.max_new_tokens)
            cache = KVCache(engine.config, 1, len(ids) + sample.max_new_tokens, engine.dtype, engine.device)
            first = engine.model.logits(prefill(engine.model, cache, [ids], 1024))  # [1, V]
            for spec in cfg.policies:
                if (task, length, spec, i) in done:
                    bar.advance(task_id)
                    continue
                cache.truncate([len(ids)])  # forget the previous policy's decoded tokens
                policy = cfg.policy(spec)
                if policy is not None:
                    build_policy(policy, engine.model, cache)
                generated = _greedy(engine, cache, first, policy, sample.max_new_tokens)
                text = engine.tokenizer.decode(generated, skip_special_tokens=True)
                attended = policy.mean_attended if policy is not None else None
                row = {"task": task, "length": length, "policy": spec, "sample": i,
                       "score": score(text, sample.answers), "tokens_attended": attended if attended is not None
                       else len(ids) + len(generated) / 2, "prompt_tokens": len(ids), "depth": sample.depth,
                       "answers": list(sample.answers), "output": text}
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                bar.advance(task_id)
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


@torch.inference_mode()
def perplexity(engine: Engine, policy: Policy | None, ids: list[int], prefix: int) -> float:
    """exp(mean NLL) of ids[prefix + 1:], each predicted by a decode step through `policy`."""
    cache = KVCache(engine.config, 1, len(ids), engine.dtype, engine.device)
    prefill(engine.model, cache, [ids[:prefix]], 1024)
    if policy is not None:
        build_policy(policy, engine.model, cache)
    nll, count = 0.0, 0
    for t in range(prefix, len(ids) - 1):
        logits = decode_step(engine.model, cache, torch.tensor([ids[t]], device=engine.device), policy=policy)
        nll -= torch.log_softmax(logits[0], -1)[ids[t + 1]].item()
        count += 1
    return math.exp(nll / count)


def run_perplexity(engine: Engine, cfg: EvalConfig, out: Path, corpus: str = "wiki",
                   progress: bool = False) -> list[dict]:
    """Perplexity of `perplexity_tokens` real tokens after a (length − those) token dense prefix, per policy."""
    path = out / "perplexity.jsonl"
    done = {(r["length"], r["policy"]) for r in map(json.loads, path.read_text().splitlines())} \
        if path.is_file() else set()
    with open(path, "a") as sink, progress_bar() as bar:
        task_id = bar.add_task("perplexity", total=len(cfg.lengths) * len(cfg.policies), visible=progress)
        for length in cfg.lengths:
            ids = engine.tokenizer(corpora.text(corpus, 2 * length, cfg.seed + 1))["input_ids"][:length]
            prefix = length - cfg.perplexity_tokens
            if prefix < 1:
                raise SparseSpecError(f"perplexity tokens must be below the length {length}")
            for spec in cfg.policies:
                if (length, spec) not in done:
                    row = {"length": length, "policy": spec, "tokens": cfg.perplexity_tokens, "corpus": corpus,
                           "perplexity": perplexity(engine, cfg.policy(spec), ids, prefix)}
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                bar.advance(task_id)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(rows: list[dict], ppl_rows: list[dict], out: Path, title: str) -> str:
    """Markdown table (task x length x policy: mean score and keys attended), plots of accuracy vs length and
    accuracy vs budget; perplexity table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["task"], r["length"], r["policy"])].append(r)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    head = "| task | length | " + " | ".join(policies) + " |"
    lines = [title, "", "Each cell: mean score (RULER string match, 0-1) over samples / mean keys attended per head "
             "in the sparse layers.", "", head, "|---|---:|" + "---:|" * len(policies)]

    def cell(group: list[dict]) -> str:
        if not group:
            return "-"
        acc = sum(g["score"] for g in group) / len(group)
        keys = sum(g["tokens_attended"] for g in group) / len(group)
        return f"{acc:.2f} / {keys:.0f} (n={len(group)})"

    for task in tasks:
        for length in lengths:
            lines.append(f"| {task} | {length} | " + " | ".join(cell(cells[(task, length, p)]) for p in policies)
                         + " |")
    for length in lengths:
        lines.append(f"| **mean** | {length} | " + " | ".join(
            cell([r for r in rows if r["length"] == length and r["policy"] == p]) for p in policies) + " |")
    if ppl_rows:
        lines += ["", "| perplexity | length | " + " | ".join(policies) + " |", "|---|---:|" + "---:|" * len(policies)]
        for length in sorted({r["length"] for r in ppl_rows}):
            vals = {r["policy"]: r["perplexity"] for r in ppl_rows if r["length"] == length}
            lines.append(f"| {ppl_rows[0]['corpus']}, last {ppl_rows[0]['tokens']} tokens | {length} | " +
                         " | ".join(f"{vals[p]:.2f}" if p in vals else "-" for p in policies) + " |")
    table = "\n".join(lines)
    (out / "accuracy.md").write_text(table + "\n")

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in policies:
        pts = [(n, sum(r["score"] for r in rows if r["length"] == n and r["policy"] == p) /
                max(1, sum(1 for r in rows if r["length"] == n and r["policy"] == p))) for n in lengths]
        axes[0].plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
    axes[0].set(xlabel="context length (tokens)", ylabel="mean score over tasks", xscale="log", ylim=(0, 1.02),
                title="accuracy vs length")
    axes[0].set_xticks(lengths, [str(n) for n in lengths])
    axes[0].minorticks_off()
    by_family: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for p in policies:
        name, inline = parse_spec(p)
        policy = make_policy(name, inline)
        if name == "dense" or hasattr(policy, "target_mass"):
            continue  # no budget to plot against
        family = ":".join([name] + [x for x in inline if not x.startswith("budget=")])
        group = [r["score"] for r in rows if r["policy"] == p]
        by_family[family].append((policy.options.budget, sum(group) / len(group)))
    for family, pts in by_family.items():
        pts.sort()
        axes[1].plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=family)
    axes[1].set(xlabel="budget (share of the context)", ylabel="mean score over tasks and lengths", xscale="log",
                ylim=(0, 1.02), title="accuracy vs budget (fixed-budget policies)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)
    plt.close(fig)
    return table
