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

import dataclasses
import json
import math
import time
from collections import Counter, defaultdict
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..attention import make_policy, parse_spec
from ..errors import SparseSpecError
from ..generate import Engine, GenerationConfig
from ..progress import progress_bar
from ..results import append_rows, read_rows
from ..runner import Runner, RunnerPool, loop_capacity
from ..sampling import SamplingConfig
from .cascade import Cascade
from .decode import speculative_generate, tree_verify
from .drafters import Drafter, LookupFirst, ModelDrafter, NgramDrafter, SelfDrafter
from .prompts import KINDS, make_prompts


ROW_FILES = ("spec.jsonl",)  # in a results folder, beside spec.settings.json (results.py)


@dataclass(frozen=True)
class DraftSpec:
    """A `--draft` value parsed (`parse_drafter`): its syntax checked before any model loads."""
    # none | ngram | dflash | model | self | tree (treeN:INNER) | lookup (ngram+INNER) | window (windowN:INNER) |
    # cascade (INNER>self:POLICY)
    kind: str
    arg: str = ""  # dflash's PATH ("": the target's registered drafter), model's NAME, self's (and cascade's) POLICY
    nodes: int = 0  # tree: drafted nodes a step
    window: int = 0  # window: the DFlash drafter's context window
    inner: DraftSpec | None = None  # tree's, lookup's, window's drafter; cascade's lower drafter
    text: str = ""  # as given
    options: tuple[str, ...] = ()  # self, cascade: the policy's options (weights= apart)
    fp8: bool = False  # self, cascade: weights=fp8

    def has(self, kind: str) -> bool:
        """Whether this drafter, or one it wraps at any depth, is of `kind` (e.g. a tree, a DFlash drafter)."""
        return self.kind == kind or (self.inner is not None and self.inner.has(kind))

    def registered(self) -> bool:
        """Whether this drafter, or one it wraps, is the target's registered DFlash drafter (dflash without a PATH:
        found by the target's registry name)."""
        return (self.kind == "dflash" and not self.arg) or (self.inner is not None and self.inner.registered())


MAX_WINDOW = 1 << 30  # (a drafter's context window reaches the kernel as an int32 with its block added)


def parse_drafter(spec: str) -> DraftSpec:
    """"none" | "ngram" | "dflash" (the drafter registered for the target) | "dflash:PATH" | "model:NAME" |
    "ngram+DRAFTER" (prompt lookup where the history recurs, DRAFTER otherwise: `LookupFirst`; e.g. ngram+dflash) |
    "self:POLICY[:key=value,...]" (the target drafts for itself under a sparse attention policy; the key
    weights=fp8 drafts with FP8 copies of the target's weights) | "treeN:DRAFTER" (a drafter of per-position
    choices, dflash, whose steps verify a tree of N drafted nodes: `spec.tree`; ngram+treeN:dflash puts prompt
    lookup's copies in its trees) | "windowN:dflash[:PATH]" (the DFlash drafter's blocks see the last N >= 1
    context tokens only, in place of its file's window: e.g. tree15:window1024:dflash) | "DRAFTER>self:POLICY[:...]"
    (a cascade, `spec.cascade`: a DFlash drafter, dflash[:PATH] or windowN:dflash[:PATH], proposes to the target
    under the sparse policy, whose block passes keep what the dense verify then checks; e.g.
    dflash>self:binarypc). Raises SparseSpecError for what no model could make valid."""
    lower, cascade, upper = spec.partition(">")
    if cascade:  # the drafter before the '>' proposes to the sparse target after it
        low, high = parse_drafter(lower), parse_drafter(upper)
        if high.kind != "self":
            raise SparseSpecError(f"{spec}: DRAFTER>self:POLICY puts a drafter in front of the target under a "
                                  f"sparse policy (e.g. dflash>self:binarypc), not in front of {upper}")
        if low.kind not in ("dflash", "window"):
            raise SparseSpecError(f"{spec}: a cascade's lower drafter is a DFlash drafter's line (dflash[:PATH] or "
                                  f"windowN:dflash[:PATH]), not {lower}")
        return DraftSpec("cascade", high.arg, inner=low, text=spec, options=high.options, fp8=high.fp8)
    if spec.startswith("ngram+"):  # prompt lookup first, the drafter after the plus otherwise
        inner = parse_drafter(spec[len("ngram+"):])
        if inner.kind == "none":
            raise SparseSpecError(f"{spec}: name the drafter that drafts where the lookup finds nothing (ngram+dflash)")
        return DraftSpec("lookup", inner=inner, text=spec)
    kind, _, arg = spec.partition(":")
    if kind.startswith("tree") and arg:  # the drafter after the colon, verified as a tree
        if not (kind[4:].isascii() and kind[4:].isdigit()) or int(kind[4:]) < 1:
            raise SparseSpecError(f"{spec}: treeN:DRAFTER takes a number of tree nodes N >= 1 (e.g. tree15:dflash)")
        inner = parse_drafter(arg)
        if inner.has("tree"):
            raise SparseSpecError(f"{spec}: one tree a drafter (treeN:dflash, or ngram+treeN:dflash)")
        if not inner.has("dflash"):  # (DFlash alone drafts choices)
            raise SparseSpecError(f"{spec}: a tree verify needs a drafter of per-position choices (dflash), not "
                                  f"{arg}")
        return DraftSpec("tree", nodes=int(kind[4:]), inner=inner, text=spec)
    if kind.startswith("window") and arg:  # a DFlash drafter's context window, set at load
        if not (kind[6:].isascii() and kind[6:].isdigit()) or not 1 <= int(kind[6:]) <= MAX_WINDOW:
            raise SparseSpecError(f"{spec}: windowN:dflash takes a window of N context tokens, 1 <= N <= "
                                  f"{MAX_WINDOW} (e.g. window1024:dflash)")
        inner = parse_drafter(arg)
        if inner.kind != "dflash":
            raise SparseSpecError(f"{spec}: a context window is a DFlash drafter's (windowN:dflash[:PATH]), not {arg}")
        return DraftSpec("window", window=int(kind[6:]), inner=inner, text=spec)
    if kind in ("none", "ngram") and not arg or kind == "dflash" or kind == "model" and arg:
        return DraftSpec(kind, arg, text=spec)
    if kind == "self" and arg:
        name, options = parse_spec(arg)
        if name == "dense":
            raise SparseSpecError("--draft self:POLICY drafts with a sparse policy (dense drafts would be the "
                                  "target itself)")
        weights = [o.partition("=")[2] for o in options if o.partition("=")[0] == "weights"]
        if any(w not in ("fp8", "model") for w in weights) or len(weights) > 1:
            raise SparseSpecError(f"--draft self:...,weights=W takes fp8 (FP8 copies of the weights for the draft "
                                  f"steps) or model (the model's own, the default), got {','.join(weights)}")
        policy_options = tuple(o for o in options if o.partition("=")[0] != "weights")
        make_policy(name, list(policy_options))  # (its options checked)
        return DraftSpec(kind, arg, text=spec, options=policy_options, fp8=weights == ["fp8"])
    raise SparseSpecError(f"unknown drafter {spec!r} (choose from none, ngram, dflash, dflash:PATH, model:NAME, "
                          "ngram+dflash[:PATH], self:POLICY[:key=value,...], treeN:dflash[:PATH], "
                          "windowN:dflash[:PATH], dflash[:PATH]>self:POLICY[:key=value,...])")


def make_drafter(spec: str | DraftSpec, engine: Engine, target_name: str, device: str = "cpu",
                 dtype: str = "float32", progress: bool = False, cuda_graph: bool = True) -> Drafter | None:
    """The drafter of a `--draft` value (`parse_drafter`) for `engine`'s model; None for "none"."""
    from ..models.loading import DTYPES
    from .dflash import DFlash, DFlashDrafter
    from .registry import drafter_path

    d = parse_drafter(spec) if isinstance(spec, str) else spec
    if d.kind == "lookup":  # (in front of a tree verify too: a copy is its first choices)
        return LookupFirst(make_drafter(d.inner, engine, target_name, device, dtype, progress, cuda_graph))
    if d.kind == "tree":
        inner = make_drafter(d.inner, engine, target_name, device, dtype, progress, cuda_graph)
        if inner is None or not inner.marginals:
            raise SparseSpecError(f"{d.text}: a tree verify needs a drafter of per-position choices (dflash), not "
                                  f"{d.inner.text}")
        inner.tree_nodes, inner.name = d.nodes, d.text
        return inner
    if d.kind == "window":
        drafter = make_drafter(d.inner, engine, target_name, device, dtype, progress, cuda_graph)
        drafter.model.cfg = dataclasses.replace(drafter.model.cfg, window=d.window)
        drafter.name = d.text
        return drafter
    if d.kind == "none":
        return None
    if d.kind == "ngram":
        return NgramDrafter()
    if d.kind == "dflash":
        model = DFlash.load(Path(d.arg) if d.arg else drafter_path(target_name, progress), engine.device,
                            DTYPES[dtype])
        if model.cfg.target != engine.config:
            raise SparseSpecError(f"the DFlash drafter {d.arg or target_name} was trained for another target model")
        return DFlashDrafter(model, engine.model)
    if d.kind == "model":
        draft = Engine.from_name(d.arg, device=device, dtype=dtype, progress=progress)
        return ModelDrafter(draft, f"model:{d.arg}", target_vocab=engine.config.vocab_size, cuda_graph=cuda_graph)
    policy = make_policy(parse_spec(d.arg)[0], list(d.options))  # self, cascade
    if d.kind == "cascade":
        lower = make_drafter(d.inner, engine, target_name, device, dtype, progress, cuda_graph)
        return Cascade(lower, policy, d.text, fp8=d.fp8)
    return SelfDrafter(policy, f"self:{d.arg}", fp8=d.fp8)


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
    # every row runs to max_new_tokens past its EOS (a batch then decodes all its rows at every step, as a serving
    # engine that refills finished rows would); each row records where its output's first EOS is (`eos_at`)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.prompts < 1 or self.max_new_tokens < 2 or self.block_size < 2 or self.long_chars < 1000:
            raise SparseSpecError("bench needs prompts >= 1, max-new-tokens >= 2, block-size >= 2 and "
                                  "long-chars >= 1000")
        if self.batch < 1:
            raise SparseSpecError(f"batch must be >= 1, got {self.batch}")
        for t in self.temperatures:
            SamplingConfig(temperature=t)  # (finite, >= 0)
        if not self.kinds or set(self.kinds) - set(KINDS):
            raise SparseSpecError(f"unknown prompt kinds {','.join(self.kinds)!r} (choose from {', '.join(KINDS)})")

    def settings(self) -> dict:
        """What a results folder's rows depend on besides the target and device: everything but the drafters and
        temperatures, which only select rows (the prompts and their sampling seeds depend on prompts and kinds).
        A folder recorded before `batch` or `ignore_eos` existed holds rows of their SETTING_DEFAULTS."""
        skip = {"drafters", "temperatures"} | ({"long_chars"} if not any(k.startswith("long") for k in self.kinds)
                                                else set())
        return {k: v for k, v in asdict(self).items() if k not in skip}


SETTING_DEFAULTS = {"batch": 1, "ignore_eos": False}  # (`results.check_folder`'s defaults for bench spec folders)


def run_bench(engine: Engine, drafters: dict[str, Drafter], cfg: BenchConfig, out: Path | None = None,
              progress: bool = False, cuda_graph: bool = True, compile: bool = False, time_limit: float = 0.0,
              log=print) -> list[dict]:
    """One row per (prompt, temperature, drafter); with `out`, each row is appended to out/spec.jsonl as it is
    measured and the rows already there are skipped (plain decoding too where every drafter's rows are there).
    Prompts run in batches of `cfg.batch` (of one kind, seeded by their first prompt): plain and speculative
    decoding each decode the batch together, and a row's tokens/s is its batch's output tokens per second.
    `time_limit` (seconds, 0: none): no batch that still has rows to measure starts once the run has taken that
    long (the first always runs), so every measured prompt has its rows for every temperature and drafter; `log`
    says where it stopped (a rerun into the same `out` goes on from there). Returns the rows of `drafters` and
    `cfg.temperatures`."""
    for name, drafter in drafters.items():  # a tree that does not fit the block: refused before anything runs
        if drafter is None:
            raise SparseSpecError(f"drafter {name!r} is none: plain decoding, every row's baseline already")
        tree_verify(drafter, cfg.block_size, engine.device)
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
    t0, started = time.perf_counter(), False  # whether this run has measured a batch yet
    with progress_bar() as bar, append_rows(out / "spec.jsonl") if out is not None else nullcontext() as sink:
        task = bar.add_task("bench spec", total=len(groups) * len(cfg.temperatures) * (1 + len(drafters)),
                            visible=progress)
        for g, (first, group) in enumerate(groups):
            members = range(first, first + len(group))
            left = any((i, T, name) not in done for i in members for T in cfg.temperatures for name in drafters)
            if left and started and time_limit and time.perf_counter() - t0 >= time_limit:
                log(f"time limit ({time_limit:g} s): stopped before prompt {first}, {g} of {len(groups)} prompt "
                    f"batches done (a rerun into the same folder goes on from there)")
                break
            started = started or left
            ids = [engine.encode(p.text, chat=True) for p in group]
            for T in cfg.temperatures:
                todo = {name: d for name, d in drafters.items() if any((i, T, name) not in done for i in members)}
                if not todo:
                    bar.advance(task, 1 + len(drafters))
                    continue
                sampling = SamplingConfig(temperature=T, seed=cfg.seed + first)
                gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, sampling=sampling, cuda_graph=cuda_graph,
                                       compile=compile, stop_on_eos=not cfg.ignore_eos)
                plain = engine.generate(ids, gen, runners=runners)
                plain_tps = _output_rate([len(t) for t in plain.token_ids], plain.decode_s)
                bar.advance(task, 1 + len(drafters) - len(todo))
                for name, drafter in todo.items():
                    results = speculative_generate(engine, ids, drafter, gen, cfg.block_size, runners)
                    tps = _output_rate([len(s.token_ids) for s in results], results[0].decode_s)
                    speedup = tps / plain_tps if plain_tps > 0 else float("nan")
                    for j, (i, p, s, ref, prompt) in enumerate(zip(members, group, results, plain.token_ids, ids)):
                        same = s.token_ids == ref if T == 0 else None
                        rows.append({"prompt": i, "kind": p.kind, "temperature": T, "drafter": name,
                                     "batch": len(group), "first": first, "plain_tokens": len(ref),
                                     "tokens": len(s.token_ids), "steps": s.steps,
                                     "tau": s.tau, "committed": s.committed, "tokens_per_s": tps,
                                     "setup_s": s.setup_s,
                                     "plain_tokens_per_s": plain_tps, "speedup": speedup, "identical": same,
                                     **({"copied": s.copied} if s.copied else {}), **drafter.stats(j),
                                     **({"eos_at": first_eos(engine, s.token_ids)} if cfg.ignore_eos else {}),
                                     "divergence": None if same in (None, True) else divergence(
                                         engine, prompt, ref, s.token_ids, s.committed, cfg.block_size, gen,
                                         drafter.taps, runners)})
                        if sink is not None:
                            sink.write(json.dumps(rows[-1]) + "\n")
                            sink.flush()
                    bar.advance(task)
    return [r for r in rows if r["drafter"] in drafters and r["temperature"] in cfg.temperatures]


@torch.inference_mode()
def divergence(engine: Engine, prompt: list[int], plain: list[int], spec: list[int], committed: list[int],
               block: int, gen: GenerationConfig, taps: tuple[int, ...] = (),
               runners: RunnerPool | None = None) -> dict | None:
    """Where a greedy speculative output first leaves the plain one, and whether rounding explains it.

    Both loops are replayed teacher-forced along plain[:j] (the speculative output is the same up to its first
    differing index j), each as it ran: plain decoding's prefill then one decode step a token; speculation's
    prefill (with the drafter's `taps`) then one `block`-wide verify step per entry of `committed` (its tokens
    committed a step), each block the step's pending token and accepted proposals (its rejected proposals, which
    no committed column sees, replaced by padding), the cache advanced as the loop advanced it. Runners are sized
    as the loops size theirs (`loop_capacity`) and taken from `runners` where given (the loops' own captured and
    compiled steps); the replay is of a batch of one row, and its eager (uncaptured) verify steps are block-wide
    where the loop's were as wide as their proposals. -> None when the outputs agree (or one is a prefix of the other),
    else {"index": j, "plain_token", "spec_token", "margin": the decode step's top-1 minus top-2 logit at j,
    "delta": the largest |decode − verify| logit difference over those two tokens and the speculative token,
    "reproduced": whether the replayed steps disagree at j as the loops did, "first_difference": the first index
    whose decode and verify logits are not bitwise equal ({"index", "column": its column in its verify block,
    "delta": the largest difference over the vocabulary}; None: equal up to j), "largest_difference": the index
    of the largest such difference (alike), "resolution": the spacing of the
    model's dtype at the top logit (the LM head's output is rounded to it), "near_tie": margin
    <= 2 · max(delta, resolution) (two paths that differ by delta per logit can swap a pair closer than 2 · delta;
    a batch's GEMMs, which the one-row replay does not repeat, can move each logit by a step of the dtype)}."""
    j = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if j is None:
        return None
    out = {"index": j, "plain_token": plain[j], "spec_token": spec[j]}
    if j == 0:  # the prefill's own token, the same computation in both loops
        return {**out, "margin": None, "delta": None, "reproduced": False, "first_difference": None,
                "largest_difference": None, "near_tie": False}
    limit = engine.config.max_position

    def runner(capacity: int, taps: tuple[int, ...]) -> Runner:
        capacity = loop_capacity(capacity, limit, gen.compile, runners is not None)  # as the loops sized theirs
        if runners is not None:
            return runners.get(engine.model, 1, capacity, gen.cuda_graph, gen.compile, taps)
        return Runner(engine.model, 1, capacity, cuda_graph=gen.cuda_graph, compile=gen.compile, taps=taps)

    device = engine.device
    plain_runner = runner(len(prompt) + gen.max_new_tokens, ())
    plain_runner.prefill([prompt], gen.prefill_chunk)
    decoded = torch.stack([plain_runner.decode(torch.tensor([t], device=device))[0].float().clone()
                           for t in plain[:j]])  # [j, V]: row t predicts plain[t + 1] (each step's view copied)
    spec_runner = runner(min(len(prompt) + gen.max_new_tokens + block, limit), tuple(taps))
    spec_runner.prefill_tapped([prompt], gen.prefill_chunk)
    verified, columns, at = [], [], 0  # at: the output index of the step's pending token
    for c in committed:
        if at >= j:
            break
        tokens = plain[at:at + c] + [0] * (block - c)  # the pending token, the accepted proposals, padding
        logits = spec_runner.verify(torch.tensor([tokens], device=device), block)[0]  # [1, block, V]
        verified.append(logits[0, :c].float().clone())  # rows predict plain[at + 1 .. at + c]
        columns += range(c)
        spec_runner.truncate([len(prompt) + at + c])
        at += c
    verified = torch.cat(verified)[:j]  # [j, V]
    gaps = (decoded - verified).abs().amax(-1)  # [j] each index's largest logit difference
    differs = (gaps > 0).nonzero()[:, 0].tolist()
    worst = int(gaps.argmax())

    def where(t: int) -> dict:
        return {"index": t + 1, "column": columns[t], "delta": float(gaps[t])}

    decode, verify = decoded[j - 1], verified[j - 1]  # the step that gave index j
    top2 = decode.topk(2)
    ids = {int(top2.indices[0]), int(top2.indices[1]), spec[j]}
    delta = max(float((decode[i] - verify[i]).abs()) for i in ids)
    margin = float(top2.values[0] - top2.values[1])
    resolution = spacing(engine.dtype, float(top2.values[0]))
    return {**out, "margin": margin, "delta": delta, "resolution": resolution,
            "reproduced": int(decode.argmax()) == plain[j] and int(verify.argmax()) == spec[j],
            "first_difference": where(differs[0]) if differs else None,
            "largest_difference": where(worst) if differs else None, "near_tie": margin <= 2 * max(delta, resolution)}


def spacing(dtype: torch.dtype, x: float) -> float:
    """The distance from |x| to the next larger value representable in `dtype` (its unit in the last place)."""
    if x == 0 or not math.isfinite(x):
        return float(torch.finfo(dtype).tiny) if x == 0 else float("inf")
    return float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(abs(x)))


def first_eos(engine: Engine, tokens: list[int]) -> int | None:
    """The index of the first EOS token in an output, None without one."""
    return next((i for i, t in enumerate(tokens) if t in engine.eos_ids), None)


def before_eos(rows: list[dict]) -> tuple[float, float]:
    """For rows run past their EOS (`ignore_eos`): (the share of their output tokens after each row's first EOS,
    τ over the verify steps whose pending token came before it, counting their tokens up to the EOS, as a run that
    stops there commits them). A row's output index 0 is its first token (prefill), and its verify step s commits
    `committed[s]` tokens after the ones before."""
    tokens = past = steps = kept = 0
    for r in rows:
        n = r["tokens"]
        end = n if r.get("eos_at") is None else r["eos_at"] + 1  # tokens up to and including the EOS
        tokens, past = tokens + n, past + n - end
        at = 1  # the output index the next step's first committed token takes
        for c in r["committed"]:
            if at >= end:
                break
            steps, kept, at = steps + 1, kept + min(c, end - at), at + c  # (the tokens up to the EOS)
    return past / max(1, tokens), kept / max(1, steps)


def paced(rows: list[dict]) -> tuple[int, int] | None:
    """(plain steps, speculative steps) of the batches that `rows` belong to, each batch's as its slowest row's
    (a batch decodes until its last row stops: plain decoding its longest output's steps after the first token,
    speculation the most verify steps any of its rows took). Their ratio is the τ that a fixed cost per step turns
    into the batch's speedup; None for rows that do not say their batch (`first`, written since the 39th session)."""
    if not all("first" in r and "plain_tokens" in r for r in rows):
        return None
    batches: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        batches[r["first"]].append(r)
    return (sum(max(r["plain_tokens"] for r in b) - 1 for b in batches.values()),
            sum(max(r["steps"] for r in b) for b in batches.values()))


def _output_rate(tokens: list[int], seconds: float) -> float:
    """A batch's output tokens per second after each row's first token."""
    return sum(n - 1 for n in tokens) / seconds if seconds > 0 else float("nan")


def report(rows: list[dict], out: Path | None, title: str) -> str:
    """Markdown table per (drafter, kind, T): τ, tokens/s, plain tokens/s, speedup, identical outputs, then for a
    drafter of two sources its copied and drafted steps (`source_line`), for a cascade its sparse level's tokens a
    pass and passes a verify step, for rows run past their EOS the share after
    it and τ before it (`before_eos`), for batches of several rows the τ their slowest rows pace them at (`paced`);
    and a histogram plot of tokens committed per verify step. Rates are over the whole set (its tokens over its
    seconds), so the speedup is the set's wall-clock ratio: a mean of per-prompt rates would weigh a prompt the
    drafter copies whole (10x) as much as one it barely helps, though it takes a fraction of the time."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["drafter"], r["kind"], r["temperature"])].append(r)
    lines = [title, "", "| drafter | prompts | T | τ (tokens / verify step) | tokens/s | plain tokens/s | speedup | "
             "greedy identical |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (d, kind, T), g in sorted(groups.items(), key=lambda x: (x[0][0], x[0][1], x[0][2])):
        steps = sum(r["steps"] for r in g)
        tau = sum(sum(r["committed"]) for r in g) / max(1, steps)
        tps, ptps = _set_rate(g, "tokens_per_s"), _set_rate(g, "plain_tokens_per_s")
        same = [r["identical"] for r in g if r["identical"] is not None]
        ident = f"{sum(same)}/{len(same)}" if same else "-"
        diverged = [r.get("divergence") for r in g if r["identical"] is False]
        if diverged:  # how many of the divergences start where the plain step's top two logits nearly tie, and
            ties = sum(bool(d and d["near_tie"]) for d in diverged)  # how many the replay of both loops reproduced
            again = sum(bool(d and d.get("reproduced")) for d in diverged)
            ident += f" ({ties} of {len(diverged)} at near-ties, {again} reproduced)"
        speedup = f"{tps / ptps:.2f}x" if ptps > 0 else "-"
        lines.append(f"| {d} | {kind} ({len(g)}) | {T:g} | {tau:.2f} | {tps:.1f} | {ptps:.1f} | {speedup} | {ident} |")
    sources, levels, past, slowest = [], [], [], []  # the notes under the table, per (drafter, kind, T) in order
    for (d, kind, T), g in sorted(groups.items(), key=lambda x: x[0]):
        if any(r.get("copied") for r in g):
            sources.append(source_line(d, kind, T, g))
        if any("sparse_passes" in r for r in g):
            passes, kept = sum(r["sparse_passes"] for r in g), sum(r["sparse_kept"] for r in g)
            levels.append(f"- {d}, {kind}, T = {T:g}: the sparse level kept {kept / max(1, passes):.2f} tokens a "
                          f"pass, {passes / max(1, sum(r['steps'] for r in g)):.2f} passes a verify step")
        if any("eos_at" in r for r in g):
            share, tau = before_eos(g)
            past.append(f"- {d}, {kind}, T = {T:g}: {100 * share:.0f}% of the tokens come after a row's first EOS; "
                        f"τ over the steps before it {tau:.2f}")
        if max(r.get("batch", 1) for r in g) > 1 and (pq := paced(g)) is not None:
            slowest.append(f"- {d}, {kind}, T = {T:g}: batches paced by their slowest rows: {pq[0]} plain steps "
                           f"over {pq[1]} verify steps, paced τ {pq[0] / max(1, pq[1]):.2f}")
    notes = [block for block in (sources, levels, past, slowest) if block]
    table = "\n".join(lines + [line for block in notes for line in ["", *block]])
    if out is not None:
        (out / "spec.md").write_text(table + "\n")
        _plot(rows, out / "spec_histogram.png", title)
    return table


def source_line(drafter: str, kind: str, T: float, rows: list[dict]) -> str:
    """For a drafter of two sources (prompt lookup first): the share of verify steps that checked a copy, and τ
    over the copied and over the drafted steps."""
    steps = [(c, k) for r in rows for c, k in zip(r.get("copied", []), r["committed"])]
    parts = []
    for name, flag in (("copied", True), ("drafted", False)):
        mine = [k for c, k in steps if c == flag]
        parts.append(f"{name} {len(mine)} ({100 * len(mine) / max(1, len(steps)):.0f}%), τ "
                     f"{sum(mine) / len(mine) if mine else float('nan'):.2f}")
    return f"- {drafter}, {kind}, T = {T:g}: verify steps {'; '.join(parts)}"


def _set_rate(rows: list[dict], key: str) -> float:
    """Tokens per second over a set of prompts: their tokens over their seconds (0 when no time was measured)."""
    timed = [r for r in rows if r[key] > 0]
    seconds = sum(r["tokens"] / r[key] for r in timed)
    return sum(r["tokens"] for r in timed) / seconds if seconds > 0 else 0.0


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
