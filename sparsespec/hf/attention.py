"""Every sparsespec policy as a transformers attention implementation, `attn_implementation="sparsespec_<policy>"`.

Registered through transformers' own extension points: `AttentionInterface.register` (the attention function below)
and `AttentionMaskInterface.register` (the masks are sdpa's). Prefill, multi-token steps and the policy's dense
layers run transformers' sdpa attention unchanged; a single-token step of a sparse layer runs `policy.decode` over
the SparseCache that holds the policy's index (see cache.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from ..attention import POLICIES
from ..errors import SparseSpecError
from .cache import PREFIX, STEP_KEY, DecodeStep


def sparse_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D], key/value [B, Hkv, S, D] (what the cache's update returned) -> ([B, T, Hq, D], None)."""
    step: DecodeStep | None = kwargs.pop(STEP_KEY, None)
    if query.shape[2] == 1 and step is None:
        raise SparseSpecError(f"{module.config._attn_implementation!r} decodes through a sparsespec.hf.SparseCache: "
                              "pass cache=SparseCache(model.config, max_cache_len) to generate or forward")
    if step is None or not step.sparse:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None and not _attends_everything(attention_mask):
        raise SparseSpecError("sparse decoding needs rows without padding (batch 1, or prompts of one length)")
    policy = step.policy
    with policy.stepping(step.positions) if policy.fixed is None else nullcontext():
        out = policy.decode(step.layer, query, step.cache, step.positions_dev)
    return out.transpose(1, 2).contiguous(), None


def _attends_everything(mask: torch.Tensor) -> bool:
    """An sdpa mask (bool: True attends; float: 0 attends) without a masked key."""
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def register() -> list[str]:
    """Register `sparsespec_<policy>` for every policy (idempotent); -> the names."""
    names = [PREFIX + name for name in POLICIES]
    for name in names:
        AttentionInterface.register(name, sparse_attention_forward)
        AttentionMaskInterface.register(name, sdpa_mask)
    return names
