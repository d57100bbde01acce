"""The speculative decoding loop: draft up to B − 1 tokens, verify them in one target forward, commit, roll back.

    prefill(prompt) -> features of the tapped layers -> drafter.start; sample t0
    loop: proposals = drafter.propose(history)                       (history ends with the pending token)
          logits [k+1, V] = target([pending, *proposals]) at positions n..n+k   (one forward, B slots)
          committed = verify(proposals, logits)                      (accepted prefix + one target token)
          cache.truncate(n + accepted + 1)                           (the rollback is "don't advance")
          drafter.commit(history, accepted, features of the newly cached tokens)

The target's cache slots past the committed length hold rejected drafts: dead, rewritten by the next step. Output
stops exactly where plain decoding would (max new tokens, EOS, stop strings), so greedy output is identical.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..cache import KVCache
from ..errors import SparseSpecError
from ..generate import Engine, GenerationConfig
from ..graphs import CudaGraphStep
from ..sampling import make_generator, sample
from .drafters import Drafter
from .verify import verify_sampling


@dataclass
class SpecGeneration:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    committed: list[int] = field(default_factory=list)  # tokens committed per verify step (accepted + 1)

    @property
    def steps(self) -> int:
        return len(self.committed)

    @property
    def tau(self) -> float:
        """Mean tokens per verify step, the bonus included (1 = no proposal ever accepted)."""
        return sum(self.committed) / len(self.committed) if self.committed else float("nan")

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.committed).items()))


def _prefill_tapped(engine: Engine, cache: KVCache, prompt: list[int], taps: tuple[int, ...], chunk: int):
    """Prefill one prompt; return (last hidden [H], features [L, taps * H] or None)."""
    feats = []
    hidden = None
    for c0 in range(0, len(prompt), chunk):
        c1 = min(c0 + chunk, len(prompt))
        tokens = torch.tensor([prompt[c0:c1]], device=cache.device)
        positions = torch.arange(c0, c1, device=cache.device)[None]
        hidden, f = engine.model.forward_tapped(tokens, positions, cache, c1, taps)
        if taps:
            feats.append(f[0])
    cache.truncate([len(prompt)])
    return hidden[0, -1], torch.cat(feats) if taps else None


@torch.inference_mode()
def speculative_generate(engine: Engine, prompt: list[int], drafter: Drafter, gen: GenerationConfig,
                         block_size: int = 16) -> SpecGeneration:
    """Generate for one prompt (token ids) with `drafter` proposing up to block_size − 1 tokens per step."""
    if block_size < 2:
        raise SparseSpecError(f"block size must be >= 2 (one pending token + proposals), got {block_size}")
    if engine.config.sliding_window is not None:
        raise SparseSpecError("speculative decoding does not support sliding-window models yet")
    engine.check_fits(len(prompt), gen.max_new_tokens)
    L = len(prompt)
    capacity = min(L + gen.max_new_tokens + block_size, engine.config.max_position)
    cache = KVCache(engine.config, 1, capacity, engine.dtype, engine.device)
    rng = make_generator(gen.sampling, engine.device)
    taps = drafter.taps

    start = time.perf_counter()
    hidden, features = _prefill_tapped(engine, cache, prompt, taps, gen.prefill_chunk)
    drafter.start(prompt, features, capacity)
    first = int(sample(engine.model.logits(hidden)[None], gen.sampling, rng)[0])
    ttft = time.perf_counter() - start

    graph = None
    # the graph writes B slots per step: only when the cache has B slots of room past the last new token
    if engine.device.type == "cuda" and gen.cuda_graph and capacity == L + gen.max_new_tokens + block_size:
        graph = CudaGraphStep(engine.model, cache, block_size, taps, gen.compile)
    history = list(prompt) + [first]
    out = [first]
    committed_per_step: list[int] = []
    start = time.perf_counter()
    while not engine._stopped(out, gen):
        n = cache.lengths[0]  # = len(history) - 1: the pending token goes to slot n
        k = min(block_size - 1, capacity - n - 1)
        proposals, draft_probs = drafter.propose(history, k, gen.sampling, rng)
        proposals = proposals[:k]
        block = [history[-1]] + proposals
        if graph is not None:
            tokens = torch.tensor([block + [0] * (block_size - len(block))], device=engine.device)
            positions = torch.arange(n, n + block_size, device=engine.device)[None]
            logits, feats = graph(tokens, positions)  # [1, B, V], [1, B, taps * H] or None
        else:
            tokens = torch.tensor([block], device=engine.device)
            positions = torch.arange(n, n + len(block), device=engine.device)[None]
            hidden, feats = engine.model.forward_tapped(tokens, positions, cache, n + len(block), taps)
            logits = engine.model.logits(hidden)
        props = torch.tensor(proposals, dtype=torch.long, device=engine.device)
        if draft_probs is not None:
            draft_probs = draft_probs[: len(proposals)]
        new = verify_sampling(props, draft_probs, logits[0, : len(block)], gen.sampling, rng)
        accepted = len(new) - 1
        cache.truncate([n + accepted + 1])
        history += new
        drafter.commit(history, accepted, None if feats is None else feats[0, : accepted + 1])
        used = 0  # tokens of this step that reach the output (a stop may cut the step short)
        for t in new:
            out.append(t)
            used += 1
            if engine._stopped(out, gen):
                break
        committed_per_step.append(used)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    decode_s = time.perf_counter() - start
    return SpecGeneration(out, engine._text(out, gen), L, ttft, decode_s, committed_per_step)
