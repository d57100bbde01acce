"""`sparsespec eval`: long-context accuracy of every attention policy on RULER-style tasks, and perplexity.

The samples of one (length, task) go through in batches of up to `batch` rows (right-padded, each row at its own
position). A batch's prompts are prefilled once, densely; each policy then builds its index from that cache and
decodes all rows greedily, and the cache is rolled back to the prompts (`cache.truncate`) before the next policy:
adding a policy costs only its decode. Rows go to `results.jsonl` as they come; a rerun skips the rows already
there (`sparsespec eval` records the settings they were made with: results.py). Perplexity: `perplexity_rows`
windows of real text, each one's first `prefix` tokens prefilled densely, every later token predicted by a
teacher-forced decode step through the policy (so every prediction uses its sparse attention), all windows stepping
together.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import corpora
from ..attention import check_policies, make_policy, parse_spec, shared_options
from ..attention.policy import Policy
from ..errors import SparseSpecError
from ..generate import Engine
from ..runner import Runner
from ..progress import progress_bar
from ..results import append_rows, read_rows
from .tasks import TASKS, TaskBuilder, score


ROW_FILES = ("results.jsonl", "perplexity.jsonl")  # in a results folder, beside results.settings.json (results.py)


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
    perplexity_tokens: int = 0  # tokens of real text scored per window and length (0: no perplexity)
    perplexity_rows: int = 4  # windows of real text scored together per length
    batch: int = 8  # samples of one (length, task) prefilled and decoded together

    def __post_init__(self):
        unknown = set(self.tasks) - set(TASKS)
        if unknown:
            raise SparseSpecError(f"unknown task {sorted(unknown)[0]!r} (choose from {', '.join(TASKS)})")
        if self.samples < 1:
            raise SparseSpecError(f"samples must be >= 1, got {self.samples}")
        if self.perplexity_tokens < 0 or self.perplexity_tokens == 1:
            raise SparseSpecError(f"perplexity tokens must be 0 (none) or >= 2, got {self.perplexity_tokens}")
        if self.perplexity_tokens >= min(self.lengths):
            raise SparseSpecError(f"perplexity tokens ({self.perplexity_tokens}) must be below the shortest length "
                                  f"({min(self.lengths)}): they are the last tokens of a window of that length")
        if self.perplexity_rows < 1:
            raise SparseSpecError(f"perplexity rows must be >= 1, got {self.perplexity_rows}")
        if self.batch < 1:
            raise SparseSpecError(f"batch must be >= 1, got {self.batch}")
        check_policies(self.policies, self.options)
        for spec in self.policies:
            self.policy(spec)  # validate names and options before any long work

    def policy(self, spec: str) -> Policy | None:
        """A fresh policy for `spec` (None for dense: the engine's own dense path)."""
        name, opts = shared_options(spec, self.options)
        policy = make_policy(name, opts)
        return None if name == "dense" else policy

    def settings(self) -> dict:
        """What a results folder's rows depend on besides the model: the seed (sample i of a task and length is
        made from seed + i), each sparse policy's options, the perplexity windows. Tasks, lengths, the sample
        count and policies only select rows; the batch only groups them."""
        policies = {f"policy {spec}": asdict(p.options) for spec in self.policies
                    if (p := self.policy(spec)) is not None}
        perplexity = {"perplexity": {"tokens": self.perplexity_tokens, "rows": self.perplexity_rows}}
        return {"seed": self.seed, **policies, **(perplexity if self.perplexity_tokens else {})}

    def asked(self, row: dict) -> bool:
        """Whether an accuracy or perplexity row is one this configuration asks for."""
        return row["length"] in self.lengths and row["policy"] in self.policies and (
            "task" not in row or row["task"] in self.tasks and row["sample"] < self.samples)


@torch.inference_mode()
def _greedy(engine: Engine, runner: Runner, first_logits: torch.Tensor, max_new: list[int]
            ) -> tuple[list[list[int]], list[float | None]]:
    """Greedy decode of every row until its EOS or max_new[b] tokens -> (tokens per row, keys attended per KV head
    in the sparse layers per row, averaged over that row's own steps; None for dense or without a sparse step).
    Rows that are done keep stepping until the last one is; their extra tokens are dropped."""
    policy = runner.policy
    tokens = first_logits.argmax(-1)  # [B]
    out: list[list[int]] = [[] for _ in max_new]
    snapshots: list[tuple] = [(0.0, 0)] * len(max_new)
    running = set(range(len(max_new)))
    while True:
        for b, t in enumerate(tokens.tolist()):
            if b in running:
                out[b].append(t)
                if t in engine.eos_ids or len(out[b]) == max_new[b]:
                    running.discard(b)
                    snapshots[b] = policy.attended if policy is not None else (0.0, 0)
        if not running:
            break
        tokens = runner.decode(tokens).argmax(-1)
    attended = [float(total[b]) / steps if steps else None for b, (total, steps) in enumerate(snapshots)]
    return out, attended


@torch.inference_mode()
def run_eval(engine: Engine, cfg: EvalConfig, out: Path, progress: bool = False) -> list[dict]:
    """Run every missing (task, length, sample, policy) row, appending to out/results.jsonl; return the rows
    `cfg` asks for (the folder may hold more).

    The samples some policy still lacks run in batches of up to `cfg.batch` (one prefill per batch); a policy
    decodes the whole batch but writes only its missing rows."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {(r["task"], r["length"], r["policy"], r["sample"]) for r in read_rows(results)}
    builder = TaskBuilder(engine.tokenizer)
    for task in cfg.tasks:  # a length too short for a task refused before any row (its first samples, cheap; a
        for i in range(min(cfg.samples, 3)):  # needle's kind cycles with the seed)
            builder.sample(task, min(cfg.lengths), cfg.seed + i)
    todo = {(length, task): [i for i in range(cfg.samples) if any((task, length, p, i) not in done
                                                                   for p in cfg.policies)]
            for length in cfg.lengths for task in cfg.tasks}
    with progress_bar() as bar, append_rows(results) as sink:
        task_id = bar.add_task("eval", total=sum(map(len, todo.values())) * len(cfg.policies), visible=progress)
        for (length, task), indices in todo.items():
            for start in range(0, len(indices), cfg.batch):
                batch = indices[start:start + cfg.batch]
                samples = [builder.sample(task, length, cfg.seed + i) for i in batch]
                prompts = [engine.tokenizer(s.prompt)["input_ids"] for s in samples]
                lens, max_new = [len(p) for p in prompts], [s.max_new_tokens for s in samples]
                engine.check_fits(max(lens), max(max_new))  # finished rows keep stepping until the last is done
                runner = Runner(engine.model, len(batch), max(lens) + max(max_new))
                first = engine.model.logits(runner.prefill(prompts))  # [B, V]: one dense prefill for every policy
                for spec in cfg.policies:
                    if all((task, length, spec, i) in done for i in batch):
                        bar.advance(task_id, len(batch))
                        continue
                    runner.truncate(lens)  # forget the previous policy's decoded tokens
                    runner.use(cfg.policy(spec))
                    generated, attended = _greedy(engine, runner, first, max_new)
                    for i, sample, n, ids, keys in zip(batch, samples, lens, generated, attended):
                        if (task, length, spec, i) in done:
                            continue
                        text = engine.tokenizer.decode(ids, skip_special_tokens=True)
                        row = {"task": task, "length": length, "policy": spec, "sample": i,
                               "score": score(text, sample.answers), "tokens_attended": keys if keys is not None
                               else n + len(ids) / 2, "prompt_tokens": n, "depth": sample.depth,
                               "answers": list(sample.answers), "output": text}
                        sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    bar.advance(task_id, len(batch))
    return [r for r in read_rows(results) if cfg.asked(r)]


@torch.inference_mode()
def perplexity(engine: Engine, policy: Policy | None, rows: list[list[int]], prefix: int) -> float:
    """exp(mean NLL) of every row's tokens after position `prefix` (rows [R][N] of one length N), each predicted
    by a decode step through `policy`; all rows step together after one dense prefill of their first `prefix`."""
    n = len(rows[0])
    if any(len(r) != n for r in rows) or not 0 < prefix < n - 1:
        raise SparseSpecError(f"perplexity needs rows of one length, longer than prefix + 1 = {prefix + 1} tokens")
    ids = torch.tensor(rows, device=engine.device)  # [R, N]
    runner = Runner(engine.model, len(rows), n, policy)
    runner.prefill([r[:prefix] for r in rows])
    nll = torch.zeros((), device=engine.device)
    for t in range(prefix, n - 1):
        logits = runner.decode(ids[:, t])  # [R, V]
        nll -= torch.log_softmax(logits, -1).gather(-1, ids[:, t + 1, None]).sum()
    return math.exp(float(nll) / (len(rows) * (n - 1 - prefix)))


def run_perplexity(engine: Engine, cfg: EvalConfig, out: Path, corpus: str = "wiki",
                   progress: bool = False) -> list[dict]:
    """Perplexity of `perplexity_tokens` real tokens after a (length − those) token dense prefix, per policy,
    over `perplexity_rows` windows (window r: the corpus in the order of seed + 1 + r); returns the rows `cfg` asks
    for."""
    path = out / "perplexity.jsonl"
    done = {(r["length"], r["policy"]) for r in read_rows(path)}
    with append_rows(path) as sink, progress_bar() as bar:
        task_id = bar.add_task("perplexity", total=len(cfg.lengths) * len(cfg.policies), visible=progress)
        for length in cfg.lengths:
            prefix = length - cfg.perplexity_tokens
            rows = [engine.tokenizer(corpora.text(corpus, 2 * length, cfg.seed + 1 + r))["input_ids"][:length]
                    for r in range(cfg.perplexity_rows)]
            for spec in cfg.policies:
                if (length, spec) not in done:
                    row = {"length": length, "policy": spec, "tokens": cfg.perplexity_tokens,
                           "rows": cfg.perplexity_rows, "corpus": corpus,
                           "perplexity": perplexity(engine, cfg.policy(spec), rows, prefix)}
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                bar.advance(task_id)
    return [r for r in read_rows(path) if cfg.asked(r)]


def report(rows: list[dict], ppl_rows: list[dict], out: Path, title: str) -> str:
    """Markdown table (task x length x policy: mean score and keys attended), plots of accuracy vs length and
    accuracy vs budget; perplexity table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["task"], r["length"], r["policy"])].append(r)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    head = "| task | length | " + " | ".join(map(_label, policies)) + " |"
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
    # means only over the (task, length) cells that every policy has finished, so that policies stay comparable
    full = {n: [t for t in tasks if len({len(cells[(t, n, p)]) for p in policies}) == 1 and cells[(t, n, policies[0])]]
            for n in lengths}

    def finished(length: int, policy: str) -> list[dict]:
        return [r for t in full[length] for r in cells[(t, length, policy)]]

    for length in lengths:
        label = "**mean**" if len(full[length]) == len(tasks) else f"**mean** ({len(full[length])} complete tasks)"
        lines.append(f"| {label} | {length} | " + " | ".join(cell(finished(length, p)) for p in policies) + " |")
    if ppl_rows:
        lines += ["", "| perplexity | length | " + " | ".join(policies) + " |", "|---|---:|" + "---:|" * len(policies)]
        for length in sorted({r["length"] for r in ppl_rows}):
            vals = {r["policy"]: r["perplexity"] for r in ppl_rows if r["length"] == length}
            lines.append(f"| {ppl_rows[0]['corpus']}, last {ppl_rows[0]['tokens']} tokens x "
                         f"{ppl_rows[0].get('rows', 1)} | {length} | " +
                         " | ".join(f"{vals[p]:.2f}" if p in vals else "-" for p in policies) + " |")
    table = "\n".join(lines)
    (out / "accuracy.md").write_text(table + "\n")

    # A policy family is a policy with its options but the budget: one colour, a line style per budget. Top: accuracy
    # vs length for every policy; below, one panel a length: accuracy vs keys attended per KV head, a family's
    # budgets joined by a line (adaptive policies, such as dense, top-p and Double-P, are single points).
    families: dict[str, list[str]] = defaultdict(list)
    for p in policies:
        name, inline = parse_spec(p)
        families[":".join([name] + [x for x in inline if not x.startswith("budget=")])].append(p)
    colour = {f: "black" if f == "dense" else plt.get_cmap("tab10")(i % 10) for i, f in enumerate(families)}
    style = {p: (colour[f], ("-", "--", ":", "-.")[i % 4]) for f, ps in families.items() for i, p in enumerate(ps)}
    done = [n for n in lengths if full[n]]
    mean = lambda key, n, p: sum(r[key] for r in finished(n, p)) / len(finished(n, p))  # noqa: E731
    fig = plt.figure(figsize=(max(12.0, 3.6 * len(done)), 9.5))
    grid = fig.add_gridspec(2, max(1, len(done)))
    top = fig.add_subplot(grid[0, :])
    for p in policies:
        top.plot(done, [mean("score", n, p) for n in done], marker="o", color=style[p][0], linestyle=style[p][1],
                 label=_label(p))
    top.set(xlabel="context length (tokens)", ylabel="mean score over tasks", xscale="log", ylim=(0, 1.02),
            title="accuracy vs length")
    top.set_xticks(lengths, [str(n) for n in lengths])
    top.minorticks_off()
    if policies:
        top.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    for i, n in enumerate(done):
        ax = fig.add_subplot(grid[1, i])
        for family, members in families.items():
            pts = sorted((mean("tokens_attended", n, p), mean("score", n, p)) for p in members)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colour[family])
        ax.set(xscale="log", ylim=(0, 1.02), title=f"{n} tokens")
        ax.set_xlabel("keys attended per KV head" if i == len(done) // 2 else "")  # one label: narrow panels
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("mean score over tasks" if i == 0 else "")
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)
    plt.close(fig)
    return table


def _label(spec: str) -> str:
    """A policy spec for a legend: option values that are paths shortened to the file name."""
    return re.sub(r"=[^,=]*/([^,/]+)", r"=\1", spec)
