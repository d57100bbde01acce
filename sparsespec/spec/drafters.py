"""Drafters behind one interface: n-gram prompt lookup and a smaller draft model (DFlash lives in dflash.py).

The speculative loop (decode.py) drives a drafter through three calls:

    start(prompt, features, capacity)  after the target's prefill; features [L, taps * hidden] of the prompt
                                     positions when the drafter asked for target layers (`taps`), else None;
                                     capacity = the most positions the generation can reach
    propose(history, k, cfg, rng)    history = every committed token, the last one not yet seen by the target;
                                     -> up to k proposed continuations, and the distributions they were drawn
                                     from ([k, V]) or None for point-mass proposals (argmax drafts, copies)
    commit(history, accepted, features)  after verification: `accepted` proposals were kept (then one target
                                     token); features of the tokens the target has just cached, [accepted + 1, ·]
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..attention.policy import Policy
from ..errors import SparseSpecError
from ..runner import Runner
from ..sampling import SamplingConfig
from .verify import draft_distribution


class Drafter(ABC):
    name: str = ""
    taps: tuple[int, ...] = ()  # target decoder layers whose outputs the drafter conditions on
    policy: Policy | None = None  # drafts with the target itself under this attention policy (see `bind`)

    def bind(self, runner: Runner) -> None:
        """Before `start`: the target's runner (a drafter with a `policy` drafts through it; others ignore it)."""

    @abstractmethod
    def start(self, prompt: list[int], features: torch.Tensor | None, capacity: int) -> None:
        """`capacity`: the most positions the generation will reach (prompt + new tokens + a block)."""

    @abstractmethod
    def propose(self, history: list[int], k: int, cfg: SamplingConfig,
                rng: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        ...

    def commit(self, history: list[int], accepted: int, features: torch.Tensor | None) -> None:
        """Default: nothing to update (stateless drafters)."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the history's last n tokens (longest n first, from
    `max_n` down to `min_n`) and propose the k tokens that followed it. Point-mass proposals, no model."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise SparseSpecError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.indexed = 0  # history[:indexed] has every n-gram ending before it in `index`

    def start(self, prompt, features, capacity):
        self.index, self.indexed = {}, 0

    def _extend(self, history: list[int]) -> None:
        # index n-grams that end at or before len(history) - 1, so the current suffix never matches itself
        for end in range(max(self.indexed, 1), len(history)):
            for n in self.sizes:
                if end >= n:
                    self.index[tuple(history[end - n:end])] = end
        self.indexed = max(self.indexed, len(history))

    def propose(self, history, k, cfg, rng):
        self._extend(history)
        for n in self.sizes:
            if len(history) > n:
                end = self.index.get(tuple(history[-n:]))
                if end is not None:
                    return history[end:end + k], None
        return [], None


class ModelDrafter(Drafter):
    """A smaller model of the same tokenizer drafts k tokens autoregressively (Leviathan et al.) in its own runner
    (static cache, graph-captured steps on CUDA); rejected drafts are rolled back by truncating it. At T > 0 it
    samples from, and reports, the same filtered distribution that verification applies to the target."""

    def __init__(self, engine, name: str = "model", target_vocab: int | None = None, cuda_graph: bool = True):
        if target_vocab is not None and engine.config.vocab_size != target_vocab:
            raise SparseSpecError(f"draft model vocabulary ({engine.config.vocab_size}) differs from the target's "
                                  f"({target_vocab}): a draft model must share the target's tokenizer")
        self.engine = engine
        self.name = name
        self.cuda_graph = cuda_graph  # on CUDA, replay its decode step as a CUDA graph
        self.runner: Runner | None = None
        self.drafted = 0  # proposals of the last propose() call whose K/V are in the draft cache

    def start(self, prompt, features, capacity):
        self.runner = Runner(self.engine.model, 1, capacity, cuda_graph=self.cuda_graph)
        self.runner.prefill([prompt])

    @torch.inference_mode()
    def propose(self, history, k, cfg, rng):
        runner = self.runner
        n = runner.cache.lengths[0]
        hidden = runner.forward(torch.tensor([history[n:]], device=runner.device))  # committed, not yet drafted on
        logits = self.engine.model.logits(hidden[0, -1])  # [V]
        runner.truncate([len(history)])
        proposals, probs = [], []
        for i in range(k):
            if cfg.greedy:
                token = logits.argmax(-1)
            else:
                p = draft_distribution(logits, cfg)
                token = torch.multinomial(p, 1, generator=rng)[0]
                probs.append(p)
            proposals.append(token)
            if i < k - 1:
                logits = runner.decode(token.view(1))[0]
        self.drafted = max(k - 1, 0)
        return torch.stack(proposals).tolist() if proposals else [], torch.stack(probs) if probs else None

    def commit(self, history, accepted, features):
        # the cache holds the old history and the first `drafted` proposals; keep only what was accepted
        old = len(history) - accepted - 1
        self.runner.truncate([old + min(accepted, self.drafted)])


class SelfDrafter(Drafter):
    """The target drafts for itself under a sparse attention policy (e.g. BinaryPC at 2%): k decode steps on the
    target's own runner — its weights and KV cache, no copies; graph-captured sparse steps on CUDA — then the dense
    verify step of the loop writes the block again with dense attention, so the output is the dense model's. At
    long context a sparse step reads a small part of the KV cache and the verify about what one dense step reads.
    The drafted slots are rolled back before the verify: the index never keeps a sparse step's keys."""

    def __init__(self, policy: Policy, name: str = "self"):
        self.policy = policy
        self.name = name
        self.runner: Runner | None = None

    def bind(self, runner):
        self.runner = runner

    def start(self, prompt, features, capacity):
        if self.runner is None:
            raise SparseSpecError("the self drafter drafts through the target's runner: bind it first")

    @torch.inference_mode()
    def propose(self, history, k, cfg, rng):
        runner = self.runner
        n = runner.cache.lengths[0]  # the pending token (history[-1]) goes to slot n
        token = torch.tensor([history[-1]], device=runner.device)
        proposals, probs = [], []
        for _ in range(k):
            logits = runner.decode(token)[0]  # [V]: a sparse step
            if cfg.greedy:
                token = logits.argmax(-1, keepdim=True)
            else:
                p = draft_distribution(logits, cfg)
                token = torch.multinomial(p, 1, generator=rng)
                probs.append(p)
            proposals.append(token)
        runner.truncate([n])  # the verify step writes the block again, densely
        return torch.cat(proposals).tolist() if proposals else [], torch.stack(probs) if probs else None
