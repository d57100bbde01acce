"""Long-generation quality: what short-answer tasks hide. Each policy generates hundreds of tokens from a long prompt
(essays on packaged documents, summaries, code continuations), and its text is compared with dense attention's:

    dense perplexity    the dense model's perplexity of the policy's generated tokens (its own greedy text scores
                        lowest; invented or derailed text scores higher)
    distinct-2 / -4     unique token n-grams over all n-grams of the generated text (loops drive them down)
    top-1 agreement     teacher-forced on the dense text: at each step the policy's argmax equals dense's next token
    first divergence    the first generated token where the policy's greedy text differs from dense's
    keys                keys attended per KV head and sparse layer (the policy's own count)

Greedy decoding; every row is one (prompt, policy). Rows are appended to longgen.jsonl as they are measured and a
rerun with the same settings skips them.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..attention import check_policies, make_policy, parse_spec
from ..attention.policy import Policy
from ..errors import SparseSpecError
from ..generate import Engine, GenerationConfig
from ..progress import progress_bar
from ..results import append_rows, read_rows
from ..runner import Runner
from ..spec.prompts import make_prompts

ROW_FILES = ("longgen.jsonl",)


@dataclass(frozen=True)
class LongGenConfig:
    policies: tuple[str, ...]  # "dense" and NAME[:key=value,...] variants
    kinds: tuple[str, ...] = ("long-essay", "long-code")
    prompts: int = 2  # per kind
    long_chars: int = 12_000
    max_new_tokens: int = 512
    seed: int = 0

    def __post_init__(self):
        if self.prompts < 1 or self.max_new_tokens < 8 or self.long_chars < 1000:
            raise SparseSpecError("longgen needs --prompts >= 1, --max-new-tokens >= 8 and --long-chars >= 1000")
        check_policies(self.policies)
        for spec in self.policies:
            make_policy(*parse_spec(spec))  # validates names and options before any work

    def policy(self, spec: str) -> Policy | None:
        name, opts = parse_spec(spec)
        return None if name == "dense" else make_policy(name, opts)

    def settings(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "policies"}


def prompt_digest(ids: list[int]) -> str:
    """A short fingerprint of a prompt's token ids (rows record it: a folder's rows and this machine's prompts must
    match to be compared or resumed)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def distinct(tokens: list[int], n: int) -> float:
    """Unique n-grams / n-grams of `tokens` (1.0 for a text shorter than n + 1 tokens)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.inference_mode()
def dense_scores(engine: Engine, prompt: list[int], text: list[int],
                 chunk: int = 256) -> tuple[list[float], list[tuple[int, float]]]:
    """The dense model read along `text` after `prompt` (teacher-forced, the text verified in chunks of `chunk`
    tokens) -> (its negative log-likelihood of each token; its departures: the steps i where its own greedy choice is
    not text[i], each with its margin, the log-probability of its choice less text[i]'s, in nats). A text with no
    departure is dense's own greedy continuation; one with a few small ones is it, but for those near-ties (a loop
    in it is then the model's own)."""
    runner = Runner(engine.model, 1, len(prompt) + len(text), cuda_graph=False)
    nll: list[float] = []
    departures: list[tuple[int, float]] = []

    def read(logits: torch.Tensor, at: int) -> None:  # logits [w, V] predicting text[at:at + w]
        logp = torch.log_softmax(logits.float(), -1)
        want = torch.tensor(text[at:at + logp.shape[0]], device=logp.device)
        own = logp.gather(-1, want[:, None])[:, 0]
        best, choice = logp.max(-1)
        nll.extend((-own).tolist())
        departures.extend((at + j, float(best[j] - own[j])) for j in (choice != want).nonzero()[:, 0].tolist())

    read(engine.model.logits(runner.prefill([prompt])), 0)  # [1, V]: text[0]
    for start in range(0, len(text) - 1, chunk):
        piece = text[start:min(start + chunk, len(text) - 1)]  # its logits predict text[start + 1:...]
        logits, _ = runner.verify(torch.tensor([piece], device=runner.device))  # [1, w, V]
        runner.truncate([runner.cache.lengths[0] + len(piece)])
        read(logits[0], start + 1)
    return nll, departures


@torch.inference_mode()
def teacher_forced_agreement(engine: Engine, policy: Policy | None, prompt: list[int], text: list[int]) -> float:
    """Share of the steps at which `policy`'s next-token argmax, decoding `text` teacher-forced, is text's next
    token (text: dense's greedy continuation, so dense agrees at every step)."""
    if policy is None:
        return 1.0
    runner = Runner(engine.model, 1, len(prompt) + len(text), policy)
    first = engine.model.logits(runner.prefill([prompt])).argmax(-1)  # prefill is dense: predicts text[0]
    hits = int(first[0]) == text[0]
    for i in range(len(text) - 1):
        hits += int(runner.decode(torch.tensor([text[i]], device=runner.device)).argmax(-1)[0]) == text[i + 1]
    return hits / len(text)


def run_longgen(engine: Engine, cfg: LongGenConfig, out: Path | None = None, progress: bool = False) -> list[dict]:
    """One row per (prompt, policy); dense first on every prompt (every metric compares with its text)."""
    prompts = [p for kind in cfg.kinds for p in make_prompts(cfg.prompts, "heldout", (kind,), cfg.seed,
                                                             cfg.long_chars)]
    ids = [engine.encode(p.text, chat=bool(engine.tokenizer.chat_template)) for p in prompts]
    engine.check_all_fit(ids, cfg.max_new_tokens)
    rows = read_rows(out / ROW_FILES[0]) if out is not None else []
    digests = [prompt_digest(i) for i in ids]
    for r in rows:  # rows made from other prompts (another corpus or Python standard library) must not mix in
        if "prompt_digest" in r and r["prompt"] < len(ids) and r["prompt_digest"] != digests[r["prompt"]]:
            raise SparseSpecError(f"{out} holds rows made from other prompts than this machine makes (prompt "
                                  f"{r['prompt']}: the long prompts are cut from the corpus packages and the running "
                                  f"Python's standard library): choose another --out")
    done = {(r["prompt"], r["policy"]) for r in rows}
    specs = ["dense", *[s for s in cfg.policies if s != "dense"]]
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens)
    with progress_bar() as bar:
        task = bar.add_task("longgen", total=len(ids) * len(specs), visible=progress)
        for i, (p, prompt) in enumerate(zip(prompts, ids)):
            dense_text = next((r["tokens"] for r in rows if r["prompt"] == i and r["policy"] == "dense"), None)
            for spec in specs:
                if (i, spec) in done:
                    bar.advance(task)
                    continue
                policy = cfg.policy(spec)
                text = engine.generate([prompt], gen, policy=policy).token_ids[0]
                if dense_text is None:
                    dense_text = text
                nll, departures = dense_scores(engine, prompt, text)
                fresh = cfg.policy(spec)  # the agreement pass starts from a new index
                row = {"prompt": i, "kind": p.kind, "prompt_tokens": len(prompt), "prompt_digest": digests[i],
                       "policy": spec, "generated": len(text),
                       "dense_ppl": math.exp(statistics.fmean(nll)) if nll else float("nan"),
                       "distinct2": distinct(text, 2), "distinct4": distinct(text, 4),
                       "agreement": teacher_forced_agreement(engine, fresh, prompt, dense_text),
                       "first_divergence": next((j for j, (a, b) in enumerate(zip(text, dense_text)) if a != b),
                                                min(len(text), len(dense_text))),
                       "keys": None if policy is None else policy.mean_attended,
                       "departures": [[j, round(m, 4)] for j, m in departures], "tokens": text}
                rows.append(row)
                if out is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    with append_rows(out / ROW_FILES[0]) as sink:
                        sink.write(json.dumps(row) + "\n")
                bar.advance(task)
    return [r for r in rows if r["policy"] in specs]


def report(rows: list[dict], out: Path | None, title: str) -> str:
    """Per policy (rows in the given order of first appearance): means over the prompts that every policy has
    finished (a stopped run compares its policies on the same prompts) -> a markdown table (and longgen.md /
    longgen.png in `out`)."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    complete = set.intersection(*({r["prompt"] for r in rows if r["policy"] == p} for p in policies)) if rows else set()
    rows = [r for r in rows if r["prompt"] in complete]
    mean = lambda xs: statistics.fmean(xs) if xs else float("nan")  # noqa: E731
    lines = [title, "", "| policy | prompts | tokens | dense ppl of its text | distinct-2 | distinct-4 | "
             "top-1 agreement (teacher-forced) | first divergence (median) | dense departs from its text | "
             "keys / head |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table = []
    for name in policies:
        rs = [r for r in rows if r["policy"] == name]
        keys = [r["keys"] for r in rs if r["keys"] is not None]
        cells = {"ppl": mean([r["dense_ppl"] for r in rs]), "d2": mean([r["distinct2"] for r in rs]),
                 "d4": mean([r["distinct4"] for r in rs]), "agree": mean([r["agreement"] for r in rs])}
        table.append((name, cells))
        lines.append(f"| {name} | {len(rs)} | {mean([r['generated'] for r in rs]):.0f} | {cells['ppl']:.2f} | "
                     f"{cells['d2']:.3f} | {cells['d4']:.3f} | {100 * cells['agree']:.1f}% | "
                     f"{statistics.median(r['first_divergence'] for r in rs):.0f} | {_departures(rs)} | "
                     f"{f'{mean(keys):.0f}' if keys else 'all'} |")
    text = "\n".join(lines) + "\n"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "longgen.md").write_text(text)
        _plot(table, out / "longgen.png", title)
    return text


def _departures(rows: list[dict]) -> str:
    """The report's cell: the mean count of steps at which dense's greedy choice departs from a policy's text (and
    the largest margin, nats); '-' for rows from before it was recorded."""
    if any("departures" not in r for r in rows):
        return "-"
    count = statistics.fmean(len(r["departures"]) for r in rows)
    widest = max((m for r in rows for _, m in r["departures"]), default=None)
    return f"{count:.1f}" + ("" if widest is None else f" (<= {widest:.2f})")


def _plot(table: list[tuple[str, dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _ in table]
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.5 * len(names) + 2), sharey=True)
    for ax, key, label in zip(axes, ("ppl", "d4", "agree"),
                              ("dense perplexity of the text (lower: closer to dense)", "distinct-4 (higher: fewer "
                               "loops)", "teacher-forced top-1 agreement with dense")):
        ax.barh(names, [c[key] for _, c in table], color=["gray" if n == "dense" else "tab:blue" for n in names])
        ax.set_title(label, fontsize=9)
        ax.invert_yaxis()
    fig.suptitle(title[:140], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
