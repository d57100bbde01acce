"""Capture post-RoPE queries and keys of every layer over a text (for offline calibration and fidelity)."""

from __future__ import annotations

import torch

from .cache import KVCache
from .generate import prefill
from .models.transformer import Transformer


@torch.inference_mode()
def capture_qk(model: Transformer, tokens: list[int], chunk: int = 1024, progress: bool = False):
    """Run a dense prefill of `tokens` (one row) -> (q {layer: [Hq, N, D]}, k {layer: [Hkv, N, D]}) fp32 on CPU."""
    qs: dict[int, list[torch.Tensor]] = {}
    ks: dict[int, list[torch.Tensor]] = {}

    def observe(layer: int, q: torch.Tensor, k: torch.Tensor) -> None:
        qs.setdefault(layer, []).append(q[0].float().cpu())
        ks.setdefault(layer, []).append(k[0].float().cpu())

    cache = KVCache(model.cfg, 1, len(tokens), model.embed_tokens.weight.dtype, model.embed_tokens.weight.device)
    prefill(model, cache, [tokens], chunk, progress, observer=observe)
    return ({i: torch.cat(v, dim=1) for i, v in qs.items()}, {i: torch.cat(v, dim=1) for i, v in ks.items()})
