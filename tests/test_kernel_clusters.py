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
@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_cluster_scores_equal_reference(B, Hkv, G, C, D, spread, dtype, index_dtype):
    g = torch.Generator().manual_seed(B + Hkv + G + C + D)
    qg = (torch.randn(B, Hkv, G, D, generator=g) * 2).to(dtype).to(DEVICE)
    centroids = torch.randn(B, Hkv, C, D, generator=g).to(index_dtype).to(DEVICE)
    var = (torch.rand(B, Hkv, C, D, generator=g) * 3).to(index_dtype).to(DEVICE) if spread else None
    logits, ranked = cluster_scores(qg, centroids, var)
    ref_logits, ref_ranked = cluster_scores_ref(qg, centroids, var)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ranked, ref_ranked, atol=1e-4, rtol=1e-4)
    if not spread:
        assert ranked is logits


def _index_state(B, Hkv, C, D, S, g, index_dtype=torch.float32):
    """A consistent cluster index (centroids the means of their sums, variances from the sums; some clusters
    empty) and a cache, on DEVICE."""
    from sparsespec.attention.doublep import cluster_variance

    size = torch.randint(0, 4, (B, Hkv, C), generator=g)
    size[..., 0] = 0  # an empty cluster first: the nearest must skip it
    key_sum = torch.randn(B, Hkv, C, D, generator=g) * size[..., None]
    key_sq_sum = key_sum.square() / size.clamp_min(1)[..., None] + torch.rand(B, Hkv, C, D, generator=g)
    centroids = torch.where(size[..., None] > 0, key_sum / size.clamp_min(1)[..., None], torch.randn(B, Hkv, C, D,
                                                                                                     generator=g))
    value_sum = torch.randn(B, Hkv, C, D, generator=g) * size[..., None]
    state = {"centroids": centroids.to(index_dtype), "key_sum": key_sum, "key_sq_sum": key_sq_sum,
             "value_sum": value_sum, "value_mean": (value_sum / size.clamp_min(1)[..., None]).to(index_dtype),
             "size": size,
             "spread": cluster_variance(key_sum, key_sq_sum, size).to(index_dtype),
             "assign": torch.randint(-1, C, (B, Hkv, S), generator=g)}
    return {name: t.to(DEVICE) for name, t in state.items()}


def _assert_equal(got, want, name, before=None):
    """Bitwise equality, or the first differing element with both values (and the one before the step)."""
    if torch.equal(got, want):
        return
    at = tuple((got != want).nonzero()[0].tolist())
    was = None if before is None else before[at].item()
    raise AssertionError(f"{name} differs at {at}: kernel {got[at].item()!r}, reference {want[at].item()!r}, "
                         f"before {was!r} ({int((got != want).sum())} elements)")


@pytest.mark.parametrize("B,Hkv,C,D,S", [(1, 1, 1, 16, 12), (3, 2, 37, 16, 50), (4, 3, 130, 64, 70)]
                         + ([(16, 8, 2048, 128, 20000)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize("dtype,index_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_join_leaving_equals_reference(B, Hkv, C, D, S, spread, dtype, index_dtype):
    """The key leaving each row's window joins its nearest non-empty cluster: the same cluster, sizes, slots and
    ends as the torch path, sums, centroids and variances bitwise; rows whose window did not move by exactly one
    slot, or that have no clusters, are left alone."""
    from sparsespec.kernels.clusters import join_leaving, join_leaving_ref

    g = torch.Generator().manual_seed(B * 100 + C + D + spread)
    state = _index_state(B, Hkv, C, D, S, g, index_dtype)
    if not spread:
        state["spread"] = None
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(DEVICE)
    window, sinks = 3, 2
    positions = torch.randint(sinks + window, S, (B,), generator=g)
    target = (positions - window).clamp_min(sinks)
    # each leaving key near one centroid: no two centroids within the references' rounding tolerance of it
    largest = state["size"].cpu().argmax(-1)  # [B, Hkv]: a non-empty cluster where there is one
    near = state["centroids"].cpu().float().gather(2, largest[..., None, None].expand(-1, -1, 1, D))
    k[torch.arange(B), :, (target - 1).clamp_min(0)] = (near + 0.01 * torch.randn(B, Hkv, 1, D, generator=g))[:, :, 0]
    k = k.to(dtype).to(DEVICE)
    # most rows move by one; one is a jump (nothing joins), one has no clusters
    ends = torch.where(torch.arange(B) % 3 == 2, target - 4, target - 1)
    candidates = torch.arange(B) % 4 != 3
    runs = []
    for fn in (join_leaving, join_leaving_ref):
        st = {name: None if t is None else t.clone() for name, t in state.items()}
        end = ends.clone().to(DEVICE)
        fn(k, v, positions.to(DEVICE), end, candidates.to(DEVICE), st["centroids"], st["key_sum"], st["key_sq_sum"],
           st["value_sum"], st["value_mean"], st["size"], st["spread"], st["assign"], window, sinks)
        runs.append({**st, "end": end})
    got, want = runs
    for name in ("size", "assign", "end", "centroids", "key_sum", "key_sq_sum", "value_sum", "value_mean", "spread"):
        if want[name] is not None:
            _assert_equal(got[name], want[name], name, state.get(name))
    moved = (candidates & (ends == target - 1)).to(DEVICE)
    assert torch.equal(want["end"], torch.where(moved, target.to(DEVICE), ends.to(DEVICE)))
    assert torch.equal(want["size"].sum((1, 2)) - state["size"].sum((1, 2)), moved.long() * Hkv)


@pytest.mark.parametrize("B,Hkv,G,C,D,S", [(1, 1, 1, 1, 16, 12), (3, 2, 4, 37, 16, 50), (2, 3, 7, 130, 64, 70)]
                         + ([(16, 8, 4, 2048, 128, 20000)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("spread,index_dtype", [(True, torch.float32), (False, torch.float32),
                                                (True, torch.bfloat16)])
def test_scores_with_the_join_equal_joining_then_scoring(B, Hkv, G, C, D, S, spread, index_dtype):
    """The scoring pass measures the leaving key's nearest centroids, the join re-scores the one cluster it
    changed: the index as `join_leaving_ref` leaves it, and the scores of the updated index."""
    from sparsespec.kernels.clusters import Leaving, cluster_scores_nearest, join_leaving, join_leaving_ref

    g = torch.Generator().manual_seed(B + C + D + spread)
    state = _index_state(B, Hkv, C, D, S, g, index_dtype)
    if not spread:
        state["spread"] = None
    k = torch.randn(B, Hkv, S, D, generator=g)
    window, sinks = 3, 2
    positions = torch.randint(sinks + window, S, (B,), generator=g)
    target = (positions - window).clamp_min(sinks)
    largest = state["size"].cpu().argmax(-1)
    near = state["centroids"].cpu().float().gather(2, largest[..., None, None].expand(-1, -1, 1, D))
    k[torch.arange(B), :, (target - 1).clamp_min(0)] = (near + 0.01 * torch.randn(B, Hkv, 1, D, generator=g))[:, :, 0]
    k, v = k.to(DEVICE), torch.randn(B, Hkv, S, D, generator=g).to(DEVICE)
    qg = (torch.randn(B, Hkv, G, D, generator=g) * 2).to(DEVICE)
    ends = torch.where(torch.arange(B) % 3 == 2, target - 4, target - 1)
    candidates = (torch.arange(B) % 4 != 3).to(DEVICE)
    runs = []
    for fused in (True, False):
        st = {name: None if t is None else t.clone() for name, t in state.items()}
        end = ends.clone().to(DEVICE)
        index = (st["centroids"], st["key_sum"], st["key_sq_sum"], st["value_sum"], st["value_mean"], st["size"],
                 st["spread"], st["assign"], window, sinks)
        if fused:
            leaving = Leaving(k, positions.to(DEVICE), end, candidates, st["size"], window, sinks)
            logits, ranked, nearest = cluster_scores_nearest(qg, st["centroids"], st["spread"], leaving)
            join_leaving(k, v, positions.to(DEVICE), end, candidates, *index, nearest=nearest,
                         scores=(qg, logits, ranked))
        else:
            join_leaving_ref(k, v, positions.to(DEVICE), end, candidates, *index)
            logits, ranked = cluster_scores_ref(qg, st["centroids"], st["spread"])
        runs.append({**st, "end": end, "logits": logits, "ranked": ranked})
    got, want = runs
    for name, t in want.items():
        if t is None:
            continue
        if name in ("logits", "ranked"):
            torch.testing.assert_close(got[name], t, atol=1e-4, rtol=1e-4)
        else:
            assert torch.equal(got[name], t), name
