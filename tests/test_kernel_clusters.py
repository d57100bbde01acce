"""Double-P's cluster-scoring kernel against its torch reference (CPU: Triton's interpreter at small, odd sizes;
CUDA: compiled, larger sizes too)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sparsespec.kernels.clusters import cluster_scores, cluster_scores_ref  # noqa: E402

from .conftest import DEVICE  # noqa: E402


@pytest.mark.parametrize("B,Hkv,G,C,D", [(1, 1, 1, 1, 16), (2, 3, 4, 37, 64), (3, 2, 7, 300, 128),
                                         (1, 2, 6, 65, 32)] + ([(4, 8, 4, 8192, 128)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cluster_scores_equal_reference(B, Hkv, G, C, D, spread, dtype):
    g = torch.Generator().manual_seed(B + Hkv + G + C + D)
    qg = (torch.randn(B, Hkv, G, D, generator=g) * 2).to(dtype).to(DEVICE)
    centroids = torch.randn(B, Hkv, C, D, generator=g).to(DEVICE)
    var = torch.rand(B, Hkv, C, D, generator=g).to(DEVICE) * 3 if spread else None
    logits, ranked = cluster_scores(qg, centroids, var)
    ref_logits, ref_ranked = cluster_scores_ref(qg, centroids, var)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ranked, ref_ranked, atol=1e-4, rtol=1e-4)
    if not spread:
        assert ranked is logits
