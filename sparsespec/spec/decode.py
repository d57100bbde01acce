"""The speculative decoding loop: draft up to B − 1 tokens, verify them in one target forward, commit, roll back.

    runner.prefill_tapped(prompt) -> features of the tapped layers -> drafter.start; sample t0
    loop: proposals = drafter.propose(history)                       (history ends with the pending token)
          logits [k+1, V] = runner.verify([pending, *proposals])     (one forward at n..n+k; a graph of B slots)
          committed = verify(proposals, logits)                      (accepted prefix + one target token)
          runner.truncate(n + accepted + 1)                          (the rollback is "don't advance")
          drafter.commit(history, accepted, features of the newly cached tokens)

The target's cache slots past the committed length hold rejected drafts: dead, rewritten by the next step. Output
stops exactly where plain decoding would (max new tokens, EOS, stop strings), so greedy output is identical.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..errors import SparseSpecError
from ..generate import Engine, GenerationConfig
from ..runner import Runner
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
    # room for a whole block past the last new token (else the last steps run eagerly at their own width)
    capacity = min(L + gen.max_new_tokens + block_size, engine.config.max_position)
    runner = Runner(engine.model, 1, capacity, drafter.policy, cuda_graph=gen.cuda_graph, compile=gen.compile,
                    taps=drafter.taps)
    drafter.bind(runner)
    rng = make_generator(gen.sampling, engine.device)

    start = time.perf_counter()
    hidden, features = runner.prefill_tapped([prompt], gen.prefill_chunk)
    drafter.start(prompt, None if features is None else features[0], capacity)
    first = int(sample(engine.model.logits(hidden), gen.sampling, rng)[0])
    ttft = time.perf_counter() - start

    history = list(prompt) + [first]
    out = [first]
    committed_per_step: list[int] = []
    start = time.perf_counter()
    while not engine._stopped(out, gen):
        n = runner.cache.lengths[0]  # = len(history) - 1: the pending token goes to slot n
        k = min(block_size - 1, capacity - n - 1)
        proposals, draft_probs = drafter.propose(history, k, gen.sampling, rng)
        proposals = proposals[:k]
        block = [history[-1]] + proposals
        logits, feats = runner.verify(torch.tensor([block], device=engine.device), block_size)  # [1, w, V]
        props = torch.tensor(proposals, dtype=torch.long, device=engine.device)
        if draft_probs is not None:
            draft_probs = draft_probs[: len(proposals)]
        new = verify_sampling(props, draft_probs, logits[0], gen.sampling, rng)
        accepted = len(new) - 1
        runner.truncate([n + accepted + 1])
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
