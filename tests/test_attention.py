"""Attention kernels against the dense reference: fresh random inputs, odd sizes, fp32 and bf16."""

import pytest
import torch

from sparsespec.attention.dense import causal_mask, dense_attention


def reference_attention(q, k, v, mask):
    """Softmax(q k^T / sqrt(D)) v with repeated kv heads, written out in fp64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("B,Hq,Hkv,T,S,D", [(1, 4, 2, 5, 9, 8), (3, 9, 3, 1, 33, 64), (2, 6, 6, 7, 7, 16)])
@pytest.mark.parametrize("window", [None, 4])
def test_dense_attention_matches_reference(B, Hq, Hkv, T, S, D, window):
    g = torch.Generator().manual_seed(B * 100 + S)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, T), (Hkv, S), (Hkv, S)))
    positions = torch.arange(S - T, S).expand(B, -1)
    mask = causal_mask(positions, S, window)
    torch.testing.assert_close(dense_attention(q, k, v, mask).double(), reference_attention(q, k, v, mask),
                               rtol=1e-5, atol=1e-5)

