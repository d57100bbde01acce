"""Token sampling: greedy, temperature, top-k and top-p (nucleus), seeded."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import SparseSpecError, number, whole


GREEDY_BELOW = 1e-5  # a lower temperature samples greedily, as in vLLM (logits / 1e-300 overflow to nan)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW): greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            if not number(getattr(self, name)):
                raise SparseSpecError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name, value in (("top_k", self.top_k), ("seed", 0 if self.seed is None else self.seed)):
            if not whole(value):
                raise SparseSpecError(f"{name} must be a whole number, got {value!r}")
        if not 0 <= self.temperature < float("inf"):  # (inf: every logit 0, uniform noise; nan: no order)
            raise SparseSpecError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SparseSpecError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SparseSpecError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:  # what torch.Generator takes
            raise SparseSpecError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] fp32 -> temperature-scaled logits with tokens outside top-k / top-p set to -inf."""
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p; the first is always kept (a top_p
        # below float32's range rounds to 0 against the probabilities: it would drop every token)
        drop_sorted = (probs.cumsum(-1) - probs) >= cfg.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] fp32 -> tokens [B] int64."""
    if cfg.greedy:
        return logits.argmax(-1)
    probs = filter_logits(logits, cfg).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(logits: torch.Tensor, configs: Sequence[SamplingConfig],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] fp32 -> tokens [B] int64, each row under its own settings and generator: greedy rows by one
    argmax, each other row as `sample` samples a batch of that one row."""
    tokens = logits.argmax(-1)
    for b, (cfg, generator) in enumerate(zip(configs, generators, strict=True)):
        if not cfg.greedy:
            tokens[b] = sample(logits[b:b + 1], cfg, generator)[0]
    return tokens


def make_generator(cfg: SamplingConfig, device: torch.device | str) -> torch.Generator | None:
    if cfg.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(cfg.seed if cfg.seed is not None else torch.seed())
    return gen
