"""`sparsespec bench spec`: τ, tokens/s and speedup of each drafter against plain decoding in the same engine.

For every held-out prompt (spec/prompts.py), or batch of prompts of one kind (`batch`), and temperature, plain
decoding runs first (the reference output and the speed baseline), then each drafter. Speed is output tokens per
second after each row's first token (prefill and first token excluded on both sides), of the whole batch; speedup
= speculative tokens/s over plain tokens/s on the same prompts. At
T = 0 every speculative output is compared with the plain one token for token (`identical` in each row; where they
differ, `divergence` says where and whether the plain step's top two logits nearly tie there). Rows go
to `spec.jsonl` as they are measured; a rerun skips the rows already there (`sparsespec bench spec` records the
settings they were made with, see results.py).
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..attention import make_policy, parse_spec
from ..errors import SparseSpecError
from ..generate import Engine, GenerationConfig
from ..progress import progress_bar
from ..results import read_rows
from ..runner import Runner, RunnerPool, bucket_capacity
from ..sampling import SamplingConfig
from .decode import speculative_generate
from .drafters import Drafter, ModelDrafter, NgramDrafter, SelfDrafter
from .prompts import KINDS, make_prompts


ROW_FILES = ("spec.jsonl",)  # in a results folder, beside spec.settings.json (results.py)


def make_drafter(spec: str, engine: Engine, target_name: str, device: str = "cpu", dtype: str = "float32",
                 progress: bool = False, cuda_graph: bool = True) -> Drafter | None:
    """"none" | "ngram" | "dflash" (the drafter registered for the target) | "dflash:PATH" | "model:NAME" |
    "self:POLICY[:key=value,...]" (the target drafts for itself under a sparse attention policy; the key
    weights=fp8 drafts with FP8 copies of the target's weights)."""
    from ..models.loading import DTYPES
    from .dflash import DFlash, DFlashDrafter
    from .registry import drafter_path

    kind, _, arg = spec.partition(":")
    if kind == "none" and not arg:
        return None
    if kind == "ngram" and not arg:
        return NgramDrafter()
    if kind == "dflash":
        model = DFlash.load(Path(arg) if arg else drafter_path(target_name, progress), engine.device, DTYPES[dtype])
        if model.cfg.target != engine.config:
            raise SparseSpecError(f"the DFlash drafter {arg or target_name} was trained for another target model")
        return DFlashDrafter(model, engine.model)
    if kind == "model" and arg:
        draft = Engine.from_name(arg, device=device, dtype=dtype, progress=progress)
        return ModelDrafter(draft, f"model:{arg}", target_vocab=engine.config.vocab_size, cuda_graph=cuda_graph)
    if kind == "self" and arg:
        name, options = parse_spec(arg)
        if name == "dense":
            raise SparseSpecError("--draft self:POLICY drafts with a sparse policy (dense drafts would be the "
                                  "target itself)")
        weights = [o.partition("=")[2] for o in options if o.partition("=")[0] == "weights"]
        if any(w not in ("fp8", "model") for w in weights) or len(weights) > 1:
            raise SparseSpecError(f"--draft self:...,weights=W takes fp8 (FP8 copies of the weights for the draft "
                                  f"steps) or model (the model's own, the default), got {','.join(weights)}")
        policy = make_policy(name, [o for o in options if o.partition("=")[0] != "weights"])
        return SelfDrafter(policy, f"self:{arg}", fp8=weights == ["fp8"])
    raise SparseSpecError(f"unknown drafter {spec!r} (choose from none, ngram, dflash, dflash:PATH, model:NAME, "
                          "self:POLICY[:key=value,...])")


@dataclass(frozen=True)
class BenchConfig:
    drafters: tuple[str, ...] = ("ngram", "dflash")
    prompts: int = 8  # per kind
    kinds: tuple[str, ...] = ("code", "text")  # of KINDS; the long ones: contexts of about `long_chars` characters
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 128
    block_size: int = 16
    seed: int = 0
    long_chars: int = 64_000
    batch: int = 1  # prompts decoded together (plain and speculative)

    def __post_init__(self):
        if self.prompts < 1 or self.max_new_tokens < 2 or self.block_size < 2 or self.long_chars < 1000:
            raise SparseSpecError("bench needs prompts >= 1, max-new-tokens >= 2, block-size >= 2 and "
                                  "long-chars >= 1000")
        if self.batch < 1:
            raise SparseSpecError(f"batch must be >= 1, got {self.batch}")
        if any(t < 0 for t in self.temperatures):
            raise SparseSpecError("temperatures must be >= 0")
        if not self.kinds or set(self.kinds) - set(KINDS):
            raise SparseSpecError(f"unknown prompt kinds {','.join(self.kinds)!r} (choose from {', '.join(KINDS)})")

    def settings(self) -> dict:
        """What a results folder's rows depend on besides the target and device: everything but the drafters and
        temperatures, which only select rows (the prompts and their sampling seeds depend on prompts and kinds)."""
        skip = ({"drafters", "temperatures"} | ({"long_chars"} if not any(k.startswith("long") for k in self.kinds)
                                                 else set()) | ({"batch"} if self.batch == 1 else set()))
        return {k: v for k, v in asdict(self).items() if k not in skip}


def run_bench(engine: Engine, drafters: dict[str, Drafter], cfg: BenchConfig, out: Path | None = None,
              progress: bool = False, cuda_graph: bool = True, compile: bool = False) -> list[dict]:
    """One row per (prompt, temperature, drafter); with `out`, each row is appended to out/spec.jsonl as it is
    measured and the rows already there are skipped (plain decoding too where every drafter's rows are there).
    Prompts run in batches of `cfg.batch` (of one kind, seeded by their first prompt): plain and speculative
    decoding each decode the batch together, and a row's tokens/s is its batch's output tokens per second.
    Returns the rows of `drafters` and `cfg.temperatures`."""
    prompts = [(kind, [p for p in make_prompts(cfg.prompts, "heldout", (kind,), cfg.seed, cfg.long_chars)])
               for kind in cfg.kinds]
    groups, i = [], 0  # (index of the first prompt, prompts)
    for kind, ps in prompts:
        for j in range(0, len(ps), cfg.batch):
            groups.append((i + j, ps[j:j + cfg.batch]))
        i += len(ps)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    rows = read_rows(out / "spec.jsonl") if out is not None else []
    done = {(r["prompt"], r["temperature"], r["drafter"]) for r in rows}
    runners = RunnerPool()  # prompts of one capacity share their runners' captured (and compiled) steps
    with progress_bar() as bar, open(out / "spec.jsonl", "a") if out is not None else nullcontext() as sink:
        task = bar.add_task("bench spec", total=len(groups) * len(cfg.temperatures) * (1 + len(drafters)),
                            visible=progress)
        for first, group in groups:
            ids = [engine.encode(p.text, chat=True) for p in group]
            members = range(first, first + len(group))
            for T in cfg.temperatures:
                todo = {name: d for name, d in drafters.items() if any((i, T, name) not in done for i in members)}
                if not todo:
                    bar.advance(task, 1 + len(drafters))
                    continue
                sampling = SamplingConfig(temperature=T, seed=cfg.seed + first)
                gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, sampling=sampling, cuda_graph=cuda_graph,
                                       compile=compile)
                plain = engine.generate(ids, gen, runners=runners)
                plain_tps = _output_rate([len(t) for t in plain.token_ids], plain.decode_s)
                bar.advance(task, 1 + len(drafters) - len(todo))
                for name, drafter in todo.items():
                    results = speculative_generate(engine, ids, drafter, gen, cfg.block_size, runners)
                    tps = _output_rate([len(s.token_ids) for s in results], results[0].decode_s)
                    speedup = tps / plain_tps if plain_tps > 0 else float("nan")
                    for i, p, s, ref, prompt in zip(members, group, results, plain.token_ids, ids):
                        same = s.token_ids == ref if T == 0 else None
                        rows.append({"prompt": i, "kind": p.kind, "temperature": T, "drafter": name,
                                     "batch": len(group), "tokens": len(s.token_ids), "steps": s.steps,
                                     "tau": s.tau, "committed": s.committed, "tokens_per_s": tps,
                                     "plain_tokens_per_s": plain_tps, "speedup": speedup, "identical": same,
                                     "divergence": None if same in (None, True) else divergence(
                                         engine, prompt, ref, s.token_ids, cfg.block_size, cuda_graph, compile,
                                         runners)})
                        if sink is not None:
                            sink.write(json.dumps(rows[-1]) + "\n")
                            sink.flush()
                    bar.advance(task)
    return [r for r in rows if r["drafter"] in drafters and r["temperature"] in cfg.temperatures]


@torch.inference_mode()
def divergence(engine: Engine, prompt: list[int], plain: list[int], spec: list[int], block: int,
               cuda_graph: bool = True, compile: bool = False, runners: RunnerPool | None = None) -> dict | None:
    """Where a greedy speculative output first leaves the plain one, and whether rounding explains it.

    At the first differing output index j the plain token came from a 1-token decode step and the speculative one
    from a verify block; both steps are recomputed teacher-forced from the prompt and plain[:j]: one prefill of
    the history, then a decode step and a `block`-wide verify step (its query 0) of the token plain[j - 1] (j = 0
    is the prefill's own token, the same in both loops). The recomputation approximates the loops' arithmetic: a
    batch of one row, the history's K/V from a prefill rather than from the loops' steps, and query 0 where the
    loop's token may have come from a later query of its block; `reproduced` says whether it disagrees as the
    loops did. The steps run as the loops' did (`cuda_graph`, `compile`), on a runner from `runners` where given
    (no capture or compilation of their own). -> None when the outputs agree (or one is a
    prefix of the other), else {"index": j, "plain_token", "spec_token", "margin": the decode step's top-1 minus
    top-2 logit, "delta": the largest |decode − verify| logit difference over those two tokens and the
    speculative token, "reproduced": whether the recomputed steps disagree as the loops did, "resolution": the
    spacing of the model's dtype at the top logit (the LM head's output is rounded to it), "near_tie": margin
    <= 2 · max(delta, resolution) (two paths that differ by delta per logit can swap a pair closer than 2 · delta;
    a batch's GEMMs, which the one-row recomputation does not repeat, can move each logit by a step of the dtype)}."""
    j = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if j is None:
        return None
    out = {"index": j, "plain_token": plain[j], "spec_token": spec[j]}
    if j == 0:
        return {**out, "margin": None, "delta": None, "reproduced": False, "near_tie": False}
    history = prompt + plain[:j - 1]  # the last token, plain[j - 1], is stepped
    if runners is not None:
        capacity = bucket_capacity(len(history) + block, engine.config.max_position)
        runner = runners.get(engine.model, 1, capacity, cuda_graph, compile)
    else:
        runner = Runner(engine.model, 1, len(history) + block, cuda_graph=cuda_graph, compile=compile)
    runner.prefill([history])
    n = runner.cache.lengths[0]
    token = torch.tensor([plain[j - 1]], device=engine.device)
    decode = runner.decode(token)[0].float()  # [V]
    runner.truncate([n])
    verify = runner.verify(token.expand(1, block).contiguous(), block)[0][0, 0].float()  # [V]: query 0
    top2 = decode.topk(2)
    ids = {int(top2.indices[0]), int(top2.indices[1]), spec[j]}
    delta = max(float((decode[i] - verify[i]).abs()) for i in ids)
    margin = float(top2.values[0] - top2.values[1])
    resolution = spacing(engine.dtype, float(top2.values[0]))
    return {**out, "margin": margin, "delta": delta, "resolution": resolution,
            "reproduced": int(decode.argmax()) == plain[j] and int(verify.argmax()) == spec[j],
            "near_tie": margin <= 2 * max(delta, resolution)}


def spacing(dtype: torch.dtype, x: float) -> float:
    """The distance from |x| to the next larger value representable in `dtype` (its unit in the last place)."""
    if x == 0 or not math.isfinite(x):
        return float(torch.finfo(dtype).tiny) if x == 0 else float("inf")
    return float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(abs(x)))


def _output_rate(tokens: list[int], seconds: float) -> float:
    """A batch's output tokens per second after each row's first token."""
    return sum(n - 1 for n in tokens) / seconds if seconds > 0 else float("nan")


def report(rows: list[dict], out: Path | None, title: str) -> str:
    """Markdown table per (drafter, kind, T): τ, tokens/s, plain tokens/s, speedup, identical outputs; and a
    histogram plot of tokens committed per verify step."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["drafter"], r["kind"], r["temperature"])].append(r)
    lines = [title, "", "| drafter | prompts | T | τ (tokens / verify step) | tokens/s | plain tokens/s | speedup | "
             "greedy identical |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (d, kind, T), g in sorted(groups.items(), key=lambda x: (x[0][0], x[0][1], x[0][2])):
        steps = sum(r["steps"] for r in g)
        tau = sum(sum(r["committed"]) for r in g) / max(1, steps)
        tps = sum(r["tokens_per_s"] for r in g) / len(g)
        ptps = sum(r["plain_tokens_per_s"] for r in g) / len(g)
        same = [r["identical"] for r in g if r["identical"] is not None]
        ident = f"{sum(same)}/{len(same)}" if same else "-"
        diverged = [r.get("divergence") for r in g if r["identical"] is False]
        if diverged:  # how many of the divergences start where the plain step's top two logits nearly tie
            ties = sum(bool(d and d["near_tie"]) for d in diverged)
            ident += f" ({ties} of {len(diverged)} at near-ties)"
        speedup = f"{tps / ptps:.2f}x" if ptps > 0 else "-"
        lines.append(f"| {d} | {kind} ({len(g)}) | {T:g} | {tau:.2f} | {tps:.1f} | {ptps:.1f} | {speedup} | {ident} |")
    table = "\n".join(lines)
    if out is not None:
        (out / "spec.md").write_text(table + "\n")
        _plot(rows, out / "spec_histogram.png", title)
    return table


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        series[f"{r['drafter']} {r['kind']} T={r['temperature']:g}"].update(r["committed"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = sorted(series)
    width = 0.8 / max(1, len(names))
    top = max((max(c) for c in series.values() if c), default=1)
    for j, name in enumerate(names):
        c = series[name]
        total = sum(c.values())
        xs = list(range(1, top + 1))
        ax.bar([x + j * width for x in xs], [c[x] / total for x in xs], width, label=name)
    ax.set(xlabel="tokens committed per verify step", ylabel="share of steps", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
