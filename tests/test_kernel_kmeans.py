"""The k-means assignment kernel against its torch reference (CPU: Triton's interpreter, small sizes; CUDA: larger
ones and the bf16 fast mode)."""

import pytest
import torch

from sparsespec.kernels.kmeans import nearest_centroid, nearest_centroid_ref

from .conftest import DEVICE


def _scores(points, centroids, valid):
    offset = points.double().mean(1, keepdim=True)
    p, c = points.double() - offset, centroids.double() - offset
    s = 2 * p @ c.transpose(1, 2) - c.square().sum(-1)[:, None]
    return s if valid is None else s.masked_fill(~valid[:, None], float("-inf"))


@pytest.mark.parametrize("G,N,K,D,masked", [(1, 1, 1, 16, False), (3, 100, 70, 16, True), (2, 130, 129, 64, False),
                                            (4, 65, 5, 128, True), (2, 7, 200, 32, True)])
def test_nearest_centroid_picks_the_nearest(G, N, K, D, masked):
    """Fresh random points and centroids (offset far from the origin, as keys are), odd sizes, some centroids
    invalid: the kernel's choice is the reference's, or within rounding of its score; never an invalid one."""
    gen = torch.Generator().manual_seed(G * 1000 + N + K + D)
    points = (torch.randn(G, N, D, generator=gen) + 5).to(DEVICE)
    centroids = (torch.randn(G, K, D, generator=gen) + 5).to(DEVICE)
    valid = None
    if masked:
        valid = torch.rand(G, K, generator=gen) < 0.6
        valid[:, 0] = True
        valid = valid.to(DEVICE)
    out = nearest_centroid(points, centroids, valid)
    ref = nearest_centroid_ref(points, centroids, valid)
    assert out.shape == (G, N) and out.dtype == torch.long
    s = _scores(points, centroids, valid)
    chosen, best = s.gather(2, out[..., None])[..., 0], s.gather(2, ref[..., None])[..., 0]
    assert torch.all(chosen >= best - 1e-3 * (1 + best.abs()))
    assert (out == ref).float().mean() > 0.99
    if valid is not None:
        assert valid.gather(1, out).all()


def test_ties_go_to_the_lowest_index():
    """Duplicate centroids (k-means starts from slots, not distinct keys): the lowest index, across tiles too."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 3, 16, generator=gen)
    centroids = torch.cat([base, torch.randn(1, 70, 16, generator=gen) + 50, base], 1).to(DEVICE)  # 76: two tiles
    points = base.to(DEVICE) + 0.0
    assert nearest_centroid(points, centroids).tolist() == [[0, 1, 2]]


@pytest.mark.skipif(DEVICE != "cuda", reason="tensor-core modes on CUDA")
@pytest.mark.parametrize("precision,slack,agree,block_p,block_c,warps",
                         [("tf32", 0.01, 0.99, 64, 64, 4), ("tf32", 0.01, 0.99, 128, 64, 8),
                          ("bf16", 0.05, 0.97, 64, 64, 4), ("bf16", 0.05, 0.97, 128, 128, 8)])
def test_tensor_core_modes_are_nearest_up_to_their_rounding(precision, slack, agree, block_p, block_c, warps):
    gen = torch.Generator().manual_seed(1)
    points = torch.randn(8, 4099, 128, generator=gen).cuda()
    centroids = torch.randn(8, 257, 128, generator=gen).cuda()
    out = nearest_centroid(points, centroids, precision=precision, tiling=(block_p, block_c, warps))
    s = _scores(points, centroids, None)
    chosen, best = s.gather(2, out[..., None])[..., 0], s.max(-1).values
    assert torch.all(chosen >= best - slack * (1 + best.abs()))
    assert (out == s.argmax(-1)).float().mean() > agree
