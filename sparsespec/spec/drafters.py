"""Drafters behind one interface: n-gram prompt lookup and a smaller draft model (DFlash lives in dflash.py).

The speculative loop (decode.py) drives a drafter through three calls, for every row of a batch at once:

    start(prompts, features, capacity)  after the target's prefill; features[r] [L_r, taps * hidden] of row r's
                                     prompt positions when the drafter asked for target layers (`taps`), else
                                     None; capacity = the most positions a row reaches
    propose(histories, ks, cfgs, rngs)  histories[r] = every committed token of row r, the last one not yet seen by
                                     the target, or None for a row that has stopped (propose nothing, keep its
                                     state); -> per row up to ks[r] proposed continuations, and the distributions
                                     they were drawn from ([k_r, V], drawn under cfgs[r] with rngs[r]) or None for
                                     point-mass proposals (argmax drafts, copies)
    propose_greedy(histories, ks, device)  every decoding row greedy: the proposals as one tensor on the target's
                                     device ([B, K] and per row how many it proposes); drafters that draft on the
                                     device leave them there, so the verify step is queued behind the drafts
                                     without reading them back
    commit(lengths, accepted, features)  after verification: row r kept accepted[r] proposals (then one target
                                     token; None for a stopped row) and has lengths[r] committed tokens now (its
                                     history's length; None for a stopped row); features [B, w, taps * hidden] of
                                     the verify block (row r's first accepted[r] + 1 are its newly cached tokens)

A row's proposals and random draws depend on that row alone, so a batch drafts for each row what it would alone.
Continuous batching (`serve`) starts rows one at a time: `start` of the empty batch, then `start_row` as each
row's prompt completes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..attention.policy import Policy, device_ints
from ..errors import SparseSpecError
from ..runner import Runner
from ..sampling import SamplingConfig
from .verify import draft_distribution

if TYPE_CHECKING:
    from .tree import TreeVerify

Rows = list[list[int] | None]  # per row its history, None for a row that has stopped


class Drafter(ABC):
    name: str = ""
    taps: tuple[int, ...] = ()  # target decoder layers whose outputs the drafter conditions on
    policy: Policy | None = None  # drafts with the target itself under this attention policy (see `bind`)
    # proposals are the same at every temperature (argmax drafts, copies; reported distributions None), so
    # `propose_greedy` serves sampled rows too: the drafts stay on the device and a step reads back once
    point_mass: bool = False
    max_proposals: int | None = None  # the most proposals a row's step can take from it (None: any number)
    # drafts a distribution per position of a block (not a line): `choices` and `propose_choices` serve a tree verify
    marginals: bool = False
    tree_nodes: int = 0  # > 0 (a drafter of `marginals`): its steps verify a tree of this many drafted nodes
    tree: TreeVerify | None = None  # its tree verify (`decode.tree_verify`), kept for a loop's later calls
    vocab_size: int | None = None  # a draft model's vocabulary, which must be the target's (None: no model of its own)

    def bind(self, runner: Runner) -> None:
        """Before `start`: the target's runner (a drafter with a `policy` drafts through it; others ignore it)."""

    @abstractmethod
    def start(self, prompts: list[list[int]], features: list[torch.Tensor] | None, capacity: int) -> None:
        """`capacity`: the most positions any row will reach (prompt + new tokens + a block)."""

    def capture(self) -> None:
        """After `start`, on CUDA: capture the drafter's graphs now, before the timed decoding (else at first use)."""

    def start_row(self, row: int, prompt: list[int], features: torch.Tensor | None) -> None:
        """Continuous batching: row `row` (of a batch started with `start`) begins `prompt`, now in the target's
        cache; features [L, taps * hidden] of its positions when the drafter has `taps`."""
        raise SparseSpecError(f"the {self.name} drafter does not start rows one at a time")

    @abstractmethod
    def propose(self, histories: Rows, ks: list[int], cfgs: list[SamplingConfig],
                rngs: list[torch.Generator | None]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        ...

    def propose_greedy(self, histories: Rows, ks: list[int], device: torch.device) -> tuple[torch.Tensor, list[int]]:
        """`propose` for a batch whose decoding rows are all greedy -> (drafts [B, K] long on `device`, counts): row
        r proposes its first counts[r] <= ks[r] (0 for a stopped row); the other columns are padding, any token id.
        Valid until the drafter's next call. Default: `propose`'s proposals, uploaded (drafters that draft on the
        host); drafters that draft on the device override it and read nothing back."""
        B = len(histories)
        proposals, _ = self.propose(histories, ks, [SamplingConfig()] * B, [None] * B)
        counts = [len(p) for p in proposals]
        width = max(counts, default=0)
        return device_ints([p + [0] * (width - len(p)) for p in proposals], device).view(B, width), counts

    def read_back(self, histories: Rows, ks: list[int], device: torch.device):
        """`propose` of a point-mass drafter that drafts on the device: its `propose_greedy` drafts as lists of ints
        (one read-back), with no distributions."""
        drafts, counts = self.propose_greedy(histories, ks, device)
        return [row[:n] for row, n in zip(drafts.tolist(), counts)], [None] * len(histories)

    def choices(self, ranks: int) -> None:
        """A drafter of `marginals`, before `start`: draft `ranks` choices a position (0: the argmax line)."""
        if ranks:
            raise SparseSpecError(f"the {self.name} drafter drafts a line, not choices a position: no tree verify")

    def propose_choices(self, histories: Rows, ks: list[int], device: torch.device):
        """A drafter of `marginals` after `choices(R)` -> (ids [B, K, R] long, log-probs [B, K, R] fp32 on `device`:
        each of the block's K positions' R likeliest tokens, best first; counts as `propose_greedy`'s)."""
        raise SparseSpecError(f"the {self.name} drafter drafts a line, not choices a position: no tree verify")

    def commit(self, lengths: list[int | None], accepted: list[int | None], features: torch.Tensor | None) -> None:
        """Default: nothing to update (stateless drafters)."""

    def stats(self, row: int) -> dict:
        """Counts of row `row` since it started that a benchmark's row records (a cascade's sparse level: its passes
        and the tokens they kept); none by default."""
        return {}

    def copied(self) -> list[bool] | None:
        """Per row, whether its last proposals were copied by a prompt lookup rather than drafted (a drafter of two
        sources, `LookupFirst`); None for a drafter of one source."""
        return None


def _sampled(logits: torch.Tensor, cfg: SamplingConfig, rng: torch.Generator | None):
    """logits [V] -> (the drafted token [1], the distribution it came from [V] or None when greedy)."""
    if cfg.greedy:
        return logits.argmax(-1, keepdim=True), None
    p = draft_distribution(logits, cfg)
    return torch.multinomial(p, 1, generator=rng), p


def _drafted(tokens: list[list[torch.Tensor]], probs: list[list[torch.Tensor]]):
    """Per row its drafted tokens ([1] each) and distributions -> (lists of ints, [k_r, V] or None) per row, with
    one host read-back for the whole batch."""
    flat = torch.cat([t for row in tokens for t in row]).tolist() if any(tokens) else []
    out, i = [], 0
    for row in tokens:
        out.append(flat[i:i + len(row)])
        i += len(row)
    return out, [torch.stack(p) if p else None for p in probs]


def _stacked(drafts: list[torch.Tensor], rows: int, device: torch.device) -> torch.Tensor:
    """Per draft step the batch's tokens [B] -> [B, steps] (steps may be 0)."""
    return torch.stack(drafts, 1) if drafts else torch.zeros(rows, 0, dtype=torch.long, device=device)


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens (longest n first, from
    `max_n` down to `min_n`) and propose the k tokens that followed it. Point-mass proposals, no model; one index
    per row."""

    name = "ngram"
    point_mass = True

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise SparseSpecError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)
        self.rows: list[_Lookup] = []

    def start(self, prompts, features, capacity):
        self.rows = [_Lookup(self.sizes, p) for p in prompts]

    def start_row(self, row, prompt, features):
        self.rows[row] = _Lookup(self.sizes, prompt)

    def propose(self, histories, ks, cfgs, rngs):
        return [[] if h is None else row.propose(h, k) for row, h, k in zip(self.rows, histories, ks)], \
            [None] * len(histories)


_UNLIKELY = -1e4  # added to a choice's log-probability: below every path of a copy (or the choice is not one)


DRAFT_FIRST_ROWS = 4  # decoding rows from which `LookupFirst` launches its drafter before the lookup on a GPU


class LookupFirst(Drafter):
    """Prompt lookup first, a model drafter otherwise: a row whose history's last tokens recur earlier (an n-gram of
    at least `min_n` tokens) and whose lookup proposes at least `min_tokens` takes the lookup's proposals this step;
    every other row takes `drafter`'s. Answers that copy from their prompt (a signature and docstring restated, a
    quoted passage) commit a whole block a step where a block drafter commits a few; elsewhere the drafter drafts as
    alone. Both draft point masses, so the output is exactly the target's (greedy) or its distribution (sampled).
    In front of a tree verify (a drafter of `marginals`, `tree_nodes`), a copying row's copy becomes the first
    choice at each position it covers, with log-probability 0: its tree holds the copy's whole line, then the
    drafter's alternatives (none on a step where the drafter is skipped, as for a line).

    The drafter's state follows every row whatever proposed: its context takes the verified features of each step
    (`commit`), and when any row takes its drafts it drafts for every decoding row (its block is written past each
    row's context, never over it); where the lookup goes first (`draft_first`), a step where every row takes the
    lookup skips it."""

    def __init__(self, drafter: Drafter, min_n: int = 4, max_n: int = 8, min_tokens: int = 4):
        if not drafter.point_mass or drafter.policy is not None:
            raise SparseSpecError(f"lookup-first drafting needs a drafter of point-mass proposals (dflash), not "
                                  f"{drafter.name}")
        if min_tokens < 1:
            raise SparseSpecError(f"min_tokens must be >= 1, got {min_tokens}")
        self.drafter, self.lookup, self.min_tokens = drafter, NgramDrafter(max_n, min_n), min_tokens
        self.took: list[bool] = []  # per row: the last step's proposals are the lookup's
        self.name, self.taps, self.point_mass = f"ngram+{drafter.name}", drafter.taps, True
        self.marginals, self.tree_nodes, self.ranks = drafter.marginals, drafter.tree_nodes, 0
        # a copied block is verified, and its features reach the drafter's context, like one of the drafter's own
        self.max_proposals, self.vocab_size = drafter.max_proposals, drafter.vocab_size

    def bind(self, runner):
        self.drafter.bind(runner)

    def start(self, prompts, features, capacity):
        self.lookup.start(prompts, features, capacity)
        self.drafter.start(prompts, features, capacity)

    def capture(self):
        self.drafter.capture()

    def start_row(self, row, prompt, features):
        self.lookup.start_row(row, prompt, features)
        self.drafter.start_row(row, prompt, features)

    def propose(self, histories, ks, cfgs, rngs):
        return self.read_back(histories, ks, torch.device("cpu"))

    def _look(self, histories, ks) -> tuple[list[list[int]], list[bool]]:
        """-> each row's lookup copy and whether it takes it this step (recorded for `copied`)."""
        short = [k if self.max_proposals is None else min(k, self.max_proposals) for k in ks]
        looked, _ = self.lookup.propose(histories, short, [SamplingConfig()] * len(histories), [None] * len(histories))
        self.took = [h is not None and len(p) >= self.min_tokens for h, p in zip(histories, looked)]
        return looked, self.took

    @staticmethod
    def draft_first(histories, device) -> bool:
        """Whether a step launches the drafter before the lookup: on a GPU (the launch returns before the draft is
        done, so the lookup's host time, up to ~27 us a row at 25k-token contexts on a 2-core CPU, runs while the
        GPU drafts) with DRAFT_FIRST_ROWS rows or more decoding. Else the lookup goes first and a step where every
        decoding row copies skips the drafter (at batch 1 a third of the steps at long context; at 4 rows and more
        a step where all copy is rare; on a CPU nothing runs meanwhile)."""
        return torch.device(device).type == "cuda" and sum(h is not None for h in histories) >= DRAFT_FIRST_ROWS

    def _look_and_draft(self, histories, ks, device, draft, none):
        """-> (each row's lookup copy, whether it takes it, `draft()` or `none()`), the drafter launched first where
        `draft_first` says. Either way each row's proposals (and a tree's choices) are the same."""
        drafted = draft() if self.draft_first(histories, device) else None
        looked, use = self._look(histories, ks)
        if all(u or h is None for u, h in zip(use, histories)):  # every decoding row copies: no model draft (one
            return looked, use, none()  # launched first is dropped, so a tree's nodes are the ones it gets after)
        return looked, use, draft() if drafted is None else drafted

    def propose_greedy(self, histories, ks, device):
        B = len(histories)
        looked, use, (drafts, counts) = self._look_and_draft(
            histories, ks, device, lambda: self.drafter.propose_greedy(histories, ks, device),  # [B, K]
            lambda: (torch.zeros(B, 0, dtype=torch.long, device=device), [0] * B))
        if not any(use):
            return drafts, counts
        width = max([drafts.shape[1], *(len(p) for p, u in zip(looked, use) if u)])
        copies = device_ints([p + [0] * (width - len(p)) if u else [0] * width for p, u in zip(looked, use)],
                             drafts.device).view(len(histories), width)
        chosen = device_ints(use, drafts.device, torch.bool)[:, None]
        return (torch.where(chosen, copies, torch.nn.functional.pad(drafts, (0, width - drafts.shape[1]))),
                [len(p) if u else c for p, u, c in zip(looked, use, counts)])

    def choices(self, ranks):
        self.drafter.choices(ranks)
        self.ranks = ranks

    def propose_choices(self, histories, ks, device):
        B, R = len(histories), self.ranks
        K = max(ks, default=0) if self.max_proposals is None else self.max_proposals  # the drafter's width
        looked, use, (ids, logp, counts) = self._look_and_draft(
            histories, ks, device, lambda: self.drafter.propose_choices(histories, ks, device),  # [B, K, R] each
            lambda: (torch.zeros(B, K, R, dtype=torch.long, device=device),  # rows' copies go in below
                     torch.full((B, K, R), _UNLIKELY, device=device), [0] * B))
        if not any(use):
            return ids, logp, counts
        B, K, _ = ids.shape
        looked = [p[:K] if u else [] for p, u in zip(looked, use)]
        copies = device_ints([p + [0] * (K - len(p)) for p in looked], ids.device).view(B, K, 1)
        covered = device_ints([[j < len(p) for j in range(K)] for p in looked], ids.device, torch.bool)[..., None]
        # [B, K, R]: a copied position's copy first (certain), then the drafter's choices but its last, pushed below
        # every path of the copy (a confident drafter's choice would otherwise outrank the copy's deepest nodes):
        # nodes left over extend the copy with the drafter's choices past it first
        ids = torch.where(covered, torch.cat([copies, ids[..., :-1]], -1), ids)
        logp = torch.where(covered, torch.cat([torch.zeros_like(logp[..., :1]), logp[..., :-1] + _UNLIKELY], -1), logp)
        return ids, logp, [len(p) if u else c for p, u, c in zip(looked, use, counts)]

    def commit(self, lengths, accepted, features):
        self.drafter.commit(lengths, accepted, features)

    def copied(self):
        return self.took


_HASH_BASE = 0x9E3779B97F4A7C15  # an odd 64-bit multiplier: n-gram hashes are polynomials in it, modulo 2^64
_HASH_MASK = (1 << 64) - 1


class _Lookup:
    """One row's n-gram index: n-gram -> end (exclusive) of its latest occurrence. The prompt's n-grams (tens of
    thousands at long context, indexed when the row starts, with its prefill) sit in sorted numpy tables of their
    64-bit hashes, built without a Python loop a token; the n-grams that end past the prompt go in a dict as the
    answer grows. A lookup tries the dict first (its occurrences are the later ones), then the table, whose hit is
    checked against the prompt's tokens (a hash collision is a miss, never a wrong copy)."""

    def __init__(self, sizes: range, prompt: list[int] = ()):
        self.sizes = sizes
        self.prompt = list(prompt)
        # the table: grams ending (exclusive) before the prompt's end; the one ending at its end is the history's own
        # suffix until the history grows past the prompt, so it goes in the dict then, as every later one
        tokens = np.asarray(self.prompt[:-1], dtype=np.uint64)
        self.tables = {n: _gram_table(tokens, n) for n in sizes}  # n -> (sorted hashes, ends)
        self.index: dict[tuple[int, ...], int] = {}  # grams that end at the prompt's end or later
        self.indexed = max(len(self.prompt), 1)  # every n-gram ending (exclusive) before `indexed` is indexed

    def propose(self, history: list[int], k: int) -> list[int]:
        # index n-grams that end at or before len(history) - 1, so the current suffix never matches itself
        for end in range(self.indexed, len(history)):
            for n in self.sizes:
                if end >= n:
                    self.index[tuple(history[end - n:end])] = end
        self.indexed = max(self.indexed, len(history))
        for n in self.sizes:
            if len(history) > n:
                gram = history[-n:]
                end = self.index.get(tuple(gram))
                if end is None:
                    end = self._in_prompt(gram)
                if end is not None:
                    return history[end:end + k]
        return []

    def _in_prompt(self, gram: list[int]) -> int | None:
        """The end of the latest occurrence of `gram` inside the prompt, or None."""
        hashes, ends = self.tables[len(gram)]
        h = 0
        for t in gram:
            h = (h * _HASH_BASE + t) & _HASH_MASK
        i = int(np.searchsorted(hashes, np.uint64(h)))
        if i == len(hashes) or int(hashes[i]) != h:
            return None
        end = int(ends[i])
        return end if self.prompt[end - len(gram):end] == gram else None


def _gram_table(tokens: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens [L] uint64 -> (the distinct hashes of its n-grams, sorted; the end (exclusive) of each one's latest
    occurrence), both [U]. The hash of g_0..g_{n-1} is sum g_i * BASE^(n-1-i) mod 2^64, as `_Lookup._in_prompt`
    computes it."""
    m = len(tokens) - n + 1  # grams starting at 0..m-1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):  # (wrapping modulo 2^64 is the point)
        for i in range(n):
            h = h * np.uint64(_HASH_BASE) + tokens[i:i + m]
    order = np.argsort(h, kind="stable")  # equal hashes keep the order of their occurrences
    h = h[order]
    last = np.append(h[1:] != h[:-1], True)  # the latest occurrence of each hash
    return h[last], order[last].astype(np.int64) + n


def check_vocab(draft_vocab: int | None, target_vocab: int) -> None:
    """A drafter's `vocab_size` against its target's (None: the drafter has no vocabulary of its own)."""
    if draft_vocab is not None and draft_vocab != target_vocab:
        raise SparseSpecError(f"draft model vocabulary ({draft_vocab}) differs from the target's ({target_vocab}): a "
                              f"draft model must share the target's tokenizer")


class ModelDrafter(Drafter):
    """A smaller model of the same tokenizer drafts k tokens autoregressively (Leviathan et al.) in its own runner
    (static cache of the batch's rows, graph-captured steps on CUDA); rejected drafts are rolled back by truncating
    it. At T > 0 it samples from, and reports, the same filtered distribution that verification applies to the
    target."""

    def __init__(self, engine, name: str = "model", target_vocab: int | None = None, cuda_graph: bool = True):
        if target_vocab is not None:
            check_vocab(engine.config.vocab_size, target_vocab)
        self.engine = engine
        self.vocab_size = engine.config.vocab_size
        self.name = name
        self.cuda_graph = cuda_graph  # on CUDA, replay its decode step as a CUDA graph
        self.runner: Runner | None = None
        self.drafted: list[int] = []  # per row: proposals of the last propose() whose K/V are in the draft cache

    def bind(self, runner):
        check_vocab(self.vocab_size, runner.model.cfg.vocab_size)  # (`target_vocab` is optional)

    def start(self, prompts, features, capacity):
        self.runner = Runner(self.engine.model, len(prompts), capacity, cuda_graph=self.cuda_graph)
        if any(prompts):  # (continuous batching starts empty rows)
            self.runner.prefill(prompts)

    def capture(self):
        self.runner.capture()

    @torch.inference_mode()
    def start_row(self, row, prompt, features):
        self.runner.prefill_row(row, prompt, 0)

    def _catch_up(self, histories: Rows) -> torch.Tensor:
        """Feed each row the committed tokens it has not drafted on yet -> the next-token logits [B, V]; every row's
        cache then ends at its history (a stopped row is parked at slot 0: its cache is not needed again)."""
        runner = self.runner
        news = [[0] if h is None else h[n:] for h, n in zip(histories, runner.cache.lengths)]
        width = max(len(t) for t in news)  # padded to one width (the padding is rolled back)
        block = device_ints([t + t[-1:] * (width - len(t)) for t in news], runner.device)  # [B, width]
        hidden = runner.forward(block)  # [B, width, H]
        last = device_ints([len(t) - 1 for t in news], runner.device)
        logits = self.engine.model.logits(hidden[torch.arange(len(news), device=runner.device), last])  # [B, V]
        runner.truncate([0 if h is None else len(h) for h in histories])
        return logits

    @torch.inference_mode()
    def propose(self, histories, ks, cfgs, rngs):
        logits = self._catch_up(histories)
        kmax = max((k for h, k in zip(histories, ks) if h is not None), default=0)
        tokens, probs = [[] for _ in histories], [[] for _ in histories]
        for i in range(kmax):
            step = []
            best = logits.argmax(-1, keepdim=True)  # [B, 1]: every greedy row's at once
            for r, (h, k) in enumerate(zip(histories, ks)):
                if h is not None and i < k:
                    token, p = (best[r], None) if cfgs[r].greedy else _sampled(logits[r], cfgs[r], rngs[r])
                    tokens[r].append(token)
                    if p is not None:
                        probs[r].append(p)
                step.append(tokens[r][-1] if tokens[r] else logits.new_zeros(1, dtype=torch.long))
            if i < kmax - 1:
                logits = self.runner.decode(torch.cat(step))  # [B, V]
        self.drafted = [max(min(k, kmax) - 1, 0) for k in ks]
        return _drafted(tokens, probs)

    @torch.inference_mode()
    def propose_greedy(self, histories, ks, device):
        logits = self._catch_up(histories)
        kmax = max((k for h, k in zip(histories, ks) if h is not None), default=0)
        drafts = []
        for i in range(kmax):  # every row drafts kmax tokens; a row wanting fewer ignores the rest
            drafts.append(logits.argmax(-1))  # [B]
            if i < kmax - 1:
                logits = self.runner.decode(drafts[-1])
        counts = [0 if h is None else min(k, kmax) for h, k in zip(histories, ks)]
        self.drafted = [max(kmax - 1, 0) if h is not None else 0 for h in histories]
        return _stacked(drafts, len(histories), logits.device), counts

    def commit(self, lengths, accepted, features):
        # row r's cache holds its old history and its first `drafted` proposals; keep only what was accepted
        self.runner.truncate([0 if a is None else n - a - 1 + min(a, drafted)
                              for n, a, drafted in zip(lengths, accepted, self.drafted)])


class SelfDrafter(Drafter):
    """The target drafts for itself under a sparse attention policy (e.g. BinaryPC at 2%): k decode steps of every
    row on the target's own runner — its weights and KV cache, no copies; graph-captured sparse steps on CUDA —
    then the dense verify step of the loop writes the block again with dense attention, so the output is the dense
    model's. At long context a sparse step reads a small part of the KV cache and the verify about what one dense
    step reads. The drafted slots are rolled back before the verify: the index never keeps a sparse step's keys."""

    def __init__(self, policy: Policy, name: str = "self", fp8: bool = False):
        """`fp8`: the draft steps multiply with FP8 copies of the target's weights (half the bytes a step reads for
        its products; ~half the weights' memory more); the verify keeps the target's weights, so the output is
        still exactly the dense model's."""
        self.policy = policy
        self.name = name
        self.fp8 = fp8
        self.runner: Runner | None = None

    def bind(self, runner):
        self.runner = runner
        if self.fp8:
            runner.fp8_decode()

    def start(self, prompts, features, capacity):
        if self.runner is None:
            raise SparseSpecError("the self drafter drafts through the target's runner: bind it first")

    def capture(self):
        self.runner.capture()  # the sparse decode graph (and the one reusing kept selections)

    def start_row(self, row, prompt, features):
        """(The target's runner builds the row's index: `Runner.index_row`.)"""

    def _steps(self, histories: Rows, ks: list[int]) -> int:
        """How many sparse steps every row takes (a row wanting fewer takes them too): none past the cache's end."""
        return min(max((k for h, k in zip(histories, ks) if h is not None), default=0),
                   self.runner.cache.capacity - max(self.runner.cache.lengths))

    @torch.inference_mode()
    def propose(self, histories, ks, cfgs, rngs):
        runner = self.runner
        lengths = list(runner.cache.lengths)  # row r's pending token (histories[r][-1]) goes to slot lengths[r]
        step = device_ints([0 if h is None else h[-1] for h in histories], runner.device)  # [B]
        kmax = self._steps(histories, ks)
        tokens, probs = [[] for _ in histories], [[] for _ in histories]
        for i in range(kmax):
            logits = runner.decode(step)  # [B, V]: a sparse step of every row
            best = logits.argmax(-1, keepdim=True)  # [B, 1]: every greedy row's at once
            drawn = []
            for r, (h, k) in enumerate(zip(histories, ks)):
                token = step[r:r + 1]
                if h is not None and i < k:
                    token, p = (best[r], None) if cfgs[r].greedy else _sampled(logits[r], cfgs[r], rngs[r])
                    tokens[r].append(token)
                    if p is not None:
                        probs[r].append(p)
                drawn.append(token)
            step = torch.cat(drawn)
        runner.truncate(lengths)  # the verify step writes the block again, densely
        return _drafted(tokens, probs)

    @torch.inference_mode()
    def propose_greedy(self, histories, ks, device):
        runner = self.runner
        lengths = list(runner.cache.lengths)
        step = device_ints([0 if h is None else h[-1] for h in histories], runner.device)  # [B]
        kmax = self._steps(histories, ks)
        drafts = []
        for _ in range(kmax):  # every row steps kmax times; a row wanting fewer ignores the rest
            step = runner.decode(step).argmax(-1)  # [B]: a sparse step of every row
            drafts.append(step)
        runner.truncate(lengths)  # the verify step writes the block again, densely
        return _stacked(drafts, len(histories), runner.device), \
            [0 if h is None else min(k, kmax) for h, k in zip(histories, ks)]
