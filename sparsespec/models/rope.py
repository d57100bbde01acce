"""Rotary position embeddings (half-split layout, as in HF checkpoints) with default, linear and Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from ..config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling,
                        freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, scaled. `freq_factors` (GGUF `rope_freqs`) divide them."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        # Wavelengths longer than the original context / low_freq_factor are slowed down by `factor`, shorter
        # than original / high_freq_factor are kept, and the band between is blended linearly in 1/wavelength.
        wavelength = 2 * math.pi / inv
        ratio = scaling.original_max_position / wavelength
        blend = ((ratio - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0, 1)
        inv = inv / scaling.factor * (1 - blend) + inv * blend
    if freq_factors is not None:
        inv = inv / freq_factors.double()
    return inv.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """positions [B, T] int -> cos, sin [B, 1, T, head_dim] in `dtype` (computed in fp32)."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated pairwise (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
