"""Fidelity of sparse selection against dense attention, on a real model over real long text.

A context (natural text, or facts hidden in text and queried at the end) is prefilled densely, then `steps`
tokens of its continuation are decoded teacher-forced with dense attention while every layer's query is recorded.
Each policy, at each budget, then builds its index from the same cache and selects keys for the same queries; per
(step, layer, head) we compare with dense attention:

    mass recall      dense attention probability mass on the selected keys
    top-k recall     share of the oracle top-|selected| keys (group max of exact q·k) that were selected
    output error     ‖out_sparse − out_dense‖ / ‖out_dense‖ with exact attention over the selected keys
    tokens           keys attended per KV head
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import corpora
from ..attention import POLICIES, check_policies, make_policy, parse_spec, shared_options
from ..attention.dense import causal_mask, dense_attention
from ..attention.policy import SelectionOptions, attend_selected, selection_mask
from ..cache import KVCache
from ..errors import SparseSpecError
from ..runner import Runner
from ..models.transformer import Transformer
from ..progress import track

CONTEXTS = ("natural", "retrieval")


@dataclass(frozen=True)
class FidelityConfig:
    length: int = 4096
    contexts: tuple[str, ...] = CONTEXTS
    budgets: tuple[float, ...] = (0.01, 0.02, 0.05)
    policies: tuple[str, ...] = ("binarypc", "topk", "quest", "streaming", "magicpig")
    options: tuple[str, ...] = ()  # "key=value" for every policy, "policy.key=value" for one
    # a policy may carry its own options: "binarypc:sinks=4,bits=32" (a variant, reported under that name)
    steps: int = 16
    seed: int = 0

    def __post_init__(self):
        unknown = set(self.contexts) - set(CONTEXTS)
        if unknown:
            raise SparseSpecError(f"unknown context kind {sorted(unknown)[0]!r} (choose from {', '.join(CONTEXTS)})")
        if self.steps < 1 or self.length < 64:
            raise SparseSpecError("fidelity needs steps >= 1 and length >= 64")
        check_policies(self.policies, self.options)
        for spec in self.policies:  # (the sweep sets the budget: another would run under the sweep's labels)
            if "budget" in shared_options(spec, self.options)[1]:
                raise SparseSpecError(f"{spec}: fidelity sweeps the budget with --budgets; drop budget= from the "
                                      "policy's options")

    def policy(self, spec: str, budget: float | None):
        """The policy named by `spec` at `budget` (left out for a policy that takes none), with the shared options
        and the spec's own on top."""
        first = {"budget": str(budget)} if budget is not None and self.takes_budget(spec) else {}
        return make_policy(*shared_options(spec, self.options, **first))

    @staticmethod
    def takes_budget(spec: str) -> bool:
        """Whether the policy of `spec` attends a budget of keys (the top-p policies attend by mass: one run each)."""
        cls = POLICIES.get(parse_spec(spec)[0])
        return cls is None or issubclass(cls.Options, SelectionOptions)  # (an unknown name: make_policy says so)


def spec_label(spec: str) -> str:
    """A short report label for a policy spec: file options show their file name only."""
    name, inline = parse_spec(spec)
    if not inline:
        return name
    short = [f"{k}={Path(v).name}" for k, _, v in (pair.partition("=") for pair in inline)]
    return f"{name}:{','.join(short)}"


def make_context(kind: str, tokenizer, length: int, steps: int, seed: int) -> tuple[list[int], list[int]]:
    """-> (context of `length` tokens, continuation of >= `steps` tokens), both from real text.

    natural: Wikipedia leads, cut. retrieval: eight "secret code" facts at spread depths among Wikipedia text;
    the context ends by asking for them and the continuation recites them (each step must retrieve)."""
    filler = tokenizer(corpora.text("wiki", 2 * length, seed))["input_ids"]
    if kind == "natural":
        if len(filler) < length + steps:
            raise SparseSpecError("not enough corpus text for the requested length")
        return filler[:length], filler[length: length + steps]
    rng = random.Random(seed)
    names = rng.sample(["Alder", "Birch", "Cedar", "Dogwood", "Elm", "Fir", "Ginkgo", "Hazel", "Ivy", "Juniper",
                        "Larch", "Maple", "Oak", "Pine", "Rowan", "Spruce"], 8)
    codes = [str(rng.randint(1_000_000, 9_999_999)) for _ in names]
    facts = [tokenizer(f" The secret code of {n} is {c}. ")["input_ids"] for n, c in zip(names, codes)]
    question = tokenizer("\n\nQuestion: what are the secret codes of " + ", ".join(names) +
                         "?\nAnswer:")["input_ids"]
    answer = tokenizer("".join(f" The secret code of {n} is {c}." for n, c in zip(names, codes)))["input_ids"]
    room = length - len(question) - sum(map(len, facts))
    if room < len(facts) or len(filler) < room:
        raise SparseSpecError(f"length {length} is too short for the retrieval context")
    body: list[int] = []
    cuts = [round(room * (i + 0.5) / len(facts)) for i in range(len(facts))]
    start = 0
    for cut, fact in zip(cuts, facts):
        body += filler[start:cut] + fact
        start = cut
    body += filler[start:room]
    return body + question, answer[:max(steps, 1)]


@torch.inference_mode()
def record_queries(model: Transformer, context: list[int], continuation: list[int], steps: int):
    """Dense prefill + teacher-forced dense decode.

    -> (cache holding every token, queries[step][layer] [1, Hq, 1, D])."""
    N = len(context)
    runner = Runner(model, 1, N + steps, cuda_graph=False)
    runner.prefill([context], chunk=1024)
    queries: list[dict[int, torch.Tensor]] = []
    for t in range(steps):
        seen: dict[int, torch.Tensor] = {}
        runner.forward(torch.tensor([[continuation[t]]], device=runner.device),
                       observer=lambda layer, q, k, seen=seen: seen.__setitem__(layer, q.clone()))
        runner.truncate([N + t + 1])
        queries.append(seen)
    return runner.cache, queries


def _dense_reference(q: torch.Tensor, cache: KVCache, layer: int, pos: int):
    """-> (probs [Hq, pos + 1] fp32, output [1, Hq, 1, D], exact scores [Hq, pos + 1])."""
    keys, values = cache.keys(layer, pos + 1)
    Hq, Hkv, D = q.shape[1], keys.shape[1], q.shape[-1]
    k = keys[0].repeat_interleave(Hq // Hkv, dim=0).float()  # [Hq, S, D]
    scores = (q[0].float() @ k.transpose(-1, -2)).squeeze(1)  # [Hq, S]
    probs = (scores * D**-0.5).softmax(-1)
    mask = causal_mask(torch.tensor([[pos]], device=q.device), pos + 1)
    return probs, dense_attention(q, keys, values, mask), scores


def _attend(policy, layer: int, q: torch.Tensor, cache: KVCache, pos: int):
    """One step of `policy` -> (output [1, Hq, 1, D], exact slots [Hkv, S], approximated slots [Hkv, S] | None,
    centroid terms per KV head [Hkv] | None)."""
    positions = torch.tensor([pos], device=q.device)
    if hasattr(policy, "selected_slots"):  # approximating policies (Double-P): exact tokens + centroid terms
        exact, approx = policy.selected_slots(layer, q, cache, positions)
        out, stats = policy.decode_with_stats(layer, q, cache, positions)
        return out, exact[0], approx[0], stats["centroid_terms"][0].float()
    idx, valid = policy.select(layer, q, cache, positions)
    chosen = selection_mask(idx[0], valid[0], pos + 1)
    return attend_selected(q, cache.k[layer], cache.v[layer], idx, valid), chosen, None, None


def centroid_log_bias(state, q: torch.Tensor, keys: torch.Tensor, pos: int) -> float:
    """Double-P's size-weighted centroid estimate vs the truth, per cluster and query head:
    log Σ_j e^{q·k_j/√d} − (q·C/√d + log s) ≥ 0 by Jensen; the mean weighted by each cluster's true mass."""
    assign = state.assign[0, :, : pos + 1]  # [Hkv, S]
    Hkv, C = state.size.shape[1], state.size.shape[2]
    D = q.shape[-1]
    qg = q[0, :, 0].float().view(Hkv, -1, D)  # [Hkv, G, D]
    logits = (qg @ keys[0].float().transpose(-1, -2)) * D**-0.5  # [Hkv, G, S]
    member = assign >= 0
    idx = assign.clamp_min(0)[:, None].expand_as(logits)  # [Hkv, G, S]
    true = torch.full((*logits.shape[:2], C), float("-inf"), device=q.device)
    true = true.scatter_reduce(-1, idx, logits.masked_fill(~member[:, None], float("-inf")), "amax")
    shifted = torch.where(member[:, None], logits - true.gather(-1, idx), float("-inf"))  # no inf - inf
    lse = torch.zeros_like(true).scatter_add(-1, idx, shifted.exp())
    true = true + lse.log()  # [Hkv, G, C]
    est = (qg @ state.centroids[0].float().transpose(-1, -2)) * D**-0.5  # [Hkv, G, C]
    est = est + state.size[0].float().log()[:, None]
    valid = (state.size[0] > 0)[:, None].expand_as(true)
    weight = (true - torch.logsumexp(logits, -1, keepdim=True)).exp() * valid
    return ((true - est).masked_fill(~valid, 0) * weight).sum().item() / weight.sum().clamp_min(1e-30).item()


def evaluate_policy(policy, cache: KVCache, queries, context_len: int, references) -> dict:
    """Mean metrics over steps and sparse layers for one policy."""
    num_layers = len(queries[0])
    for layer in range(num_layers):
        if policy.is_sparse(layer):
            policy.build(layer, cache, [context_len])
    target = getattr(policy, "target_mass", None)
    keys_ = ("mass_recall", "exact_mass_recall", "topk_recall", "output_error", "tokens", "centroid_terms",
             "below_target", "centroid_bias")
    sums = dict.fromkeys(keys_, 0.0)
    min_mass, tokens_per_head, count = 1.0, [], 0
    for t, step in enumerate(queries):
        pos = context_len + t
        for layer in range(num_layers):
            if not policy.is_sparse(layer):
                continue
            if t:
                policy.append(layer, cache, [pos])
            q = step[layer]
            Hq = q.shape[1]
            probs, dense_out, scores = references[t][layer]
            out, exact, approx, terms = _attend(policy, layer, q, cache, pos)
            Hkv = exact.shape[0]
            covered = exact if approx is None else exact | approx
            mass = (probs * covered.repeat_interleave(Hq // Hkv, dim=0)).sum(-1)  # [Hq]
            exact_mass = (probs * exact.repeat_interleave(Hq // Hkv, dim=0)).sum(-1)
            err = (out - dense_out).float().norm(dim=-1) / dense_out.float().norm(dim=-1)  # [1, Hq, 1]
            group = scores.view(Hkv, Hq // Hkv, -1).amax(1)  # [Hkv, S]
            n_sel = exact.sum(-1)  # [Hkv]
            overlap = sum(exact[h, group[h].topk(int(n_sel[h])).indices].float().mean().item() for h in range(Hkv))
            sums["mass_recall"] += mass.mean().item()
            sums["exact_mass_recall"] += exact_mass.mean().item()
            sums["topk_recall"] += overlap / Hkv
            sums["output_error"] += err.mean().item()
            sums["tokens"] += n_sel.float().mean().item()
            sums["centroid_terms"] += 0.0 if terms is None else terms.mean().item()
            if target is not None:
                sums["below_target"] += (mass < target - 1e-6).float().mean().item()
            if approx is not None:
                sums["centroid_bias"] += centroid_log_bias(cache.policy_state[layer], q, cache.keys(layer, pos + 1)[0],
                                                           pos)
            min_mass = min(min_mass, mass.min().item())
            tokens_per_head += n_sel.float().tolist()
            count += 1
    row = {k: v / count for k, v in sums.items()}
    if target is None:
        row["below_target"] = None
    if not hasattr(policy, "selected_slots"):
        row["centroid_bias"] = None
    row["min_mass_recall"] = min_mass
    row["tokens_std"] = float(torch.tensor(tokens_per_head).std()) if len(tokens_per_head) > 1 else 0.0
    return row


def run_fidelity(model: Transformer, tokenizer, cfg: FidelityConfig, progress: bool = False,
                 out_rows: list | None = None) -> list[dict]:
    rows = [] if out_rows is None else out_rows
    for kind in cfg.contexts:
        context, continuation = make_context(kind, tokenizer, cfg.length, cfg.steps, cfg.seed)
        steps = min(cfg.steps, len(continuation))
        cache, queries = record_queries(model, context, continuation, steps)
        references = [{layer: _dense_reference(q, cache, layer, len(context) + t) for layer, q in step.items()}
                      for t, step in enumerate(queries)]
        # the top-p policies take no budget: one run each
        jobs = [(name, budget if cfg.takes_budget(name) else None) for name in cfg.policies for budget in cfg.budgets]
        for name, budget in track(list(dict.fromkeys(jobs)), f"fidelity ({kind})", enabled=progress):
            policy = cfg.policy(name, budget)
            if not (hasattr(policy, "select") or hasattr(policy, "selected_slots")):
                raise SparseSpecError(f"policy {name} exposes neither a key selection nor selected slots")
            metrics = evaluate_policy(policy, cache, queries, len(context), references)
            rows.append({"context": kind, "length": len(context), "policy": spec_label(name), "budget": budget,
                         "steps": steps, **metrics})
    return rows


def write_report(rows: list[dict], out: Path, title: str) -> str:
    """fidelity.json, a markdown table, and two plots: mass recall vs budget (fixed-budget policies) and mass
    recall vs tokens attended (every policy), one panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(rows, indent=1))

    def opt(value, fmt):
        return "-" if value is None else format(value, fmt)

    lines = [title, "",
             "| context | policy | budget | tokens/head (std) | centroid terms | mass recall (min) | exact mass | "
             "share below p | top-k recall | output rel. error | centroid log-bias |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["context"], r["tokens"])):
        lines.append(f"| {r['context']} | {r['policy']} | {opt(r['budget'], 'g')} | {r['tokens']:.0f} "
                     f"({r['tokens_std']:.0f}) | {r['centroid_terms']:.1f} | {r['mass_recall']:.3f} "
                     f"({r['min_mass_recall']:.2f}) | {r['exact_mass_recall']:.3f} | {opt(r['below_target'], '.3f')} "
                     f"| {r['topk_recall']:.3f} | {r['output_error']:.3f} | {opt(r['centroid_bias'], '.3f')} |")
    table = "\n".join(lines)
    (out / "fidelity.md").write_text(table + "\n")
    contexts = sorted({r["context"] for r in rows})
    names = sorted({r["policy"] for r in rows})
    colours = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    for fname, x_key, x_label in (("fidelity.png", "budget", "budget (share of the context)"),
                                  ("fidelity_tokens.png", "tokens", "keys attended exactly per head (mean)")):
        chosen = [r for r in rows if r[x_key] is not None]
        if not chosen:
            continue
        low = min(r["mass_recall"] for r in chosen)
        fig, axes = plt.subplots(1, len(contexts), figsize=(5.5 * len(contexts), 5), squeeze=False)
        for ax, kind in zip(axes[0], contexts):
            for name in names:
                pts = sorted((r[x_key], r["mass_recall"]) for r in chosen
                             if r["policy"] == name and r["context"] == kind)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=colours[name])
            ax.set(title=f"{kind} context", xlabel=x_label, ylabel="attention mass recall", xscale="log",
                   ylim=(max(0.0, low - 0.05), 1.0))
            if x_key == "budget":
                budgets = sorted({r["budget"] for r in chosen})
                ax.set_xticks(budgets, [f"{100 * b:g}%" for b in budgets])
                ax.minorticks_off()
            ax.grid(alpha=0.3)
        handles, labels = [], []
        for ax in axes[0]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
        fig.suptitle(title, fontsize=8)
        fig.tight_layout(rect=(0, 0.05 + 0.035 * -(-len(labels) // 3), 1, 1))
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
    return table
