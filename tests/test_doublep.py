"""Double-P against its definitions: k-means, cluster layout, the merged softmax, the two top-p stages, decoded-token
assignment and rollback, full p = dense attention."""

import itertools

import pytest
import torch

from sparsespec.attention.dense import causal_mask, dense_attention
from sparsespec.attention.doublep import (
    DoubleP, DoublePOptions, capped, cluster_sums, csr_members, kmeans, merged_attention, merged_attention_sparse,
    nearest, select_clusters, top_p_prefix,
)
from sparsespec.attention.policy import parse_options
from sparsespec.cache import KVCache
from sparsespec.config import ModelConfig
from sparsespec.errors import SparseSpecError

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_cache(B, Hkv, S, D, dtype=torch.float32, seed=0, offset=0.0, device="cpu"):
    """A one-layer cache with random keys (plus a shared offset, as real keys have) and values in every slot."""
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=Hkv * D * 2, intermediate_size=8, num_layers=1,
                      num_heads=Hkv * 2, num_kv_heads=Hkv, head_dim=D, max_position=S)
    cache = KVCache(cfg, B, S, dtype, device)
    g = torch.Generator().manual_seed(seed)
    cache.k[0].copy_(torch.randn(B, Hkv, S, D, generator=g) * 1.5 + offset * torch.randn(1, Hkv, 1, D, generator=g))
    cache.v[0].copy_(torch.randn(B, Hkv, S, D, generator=g))
    return cache


def dense_reference(q, cache, positions):
    kv_len = int(positions.max()) + 1
    k, v = cache.keys(0, kv_len)
    return dense_attention(q, k, v, causal_mask(positions[:, None], kv_len))


def grow(policy, cache, lengths, steps):
    """Commit `steps` more tokens per row, one decode step at a time (the cache already holds their K/V)."""
    for _ in range(steps):
        lengths = [n + 1 for n in lengths]
        policy.append(0, cache, lengths)
    return lengths


def clone_state(st):
    return {name: getattr(st, name).clone() for name in ("centroids", "key_sum", "key_sq_sum", "value_sum", "size",
                                                             "assign")} | {
        "clustered_end": list(st.clustered_end)}


# ---------------------------------------------------------------------------------------------- full p = dense

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decoded,sinks,window,cluster_size", [
    ("assign", 3, 5, 4), ("window", 4, 7, 3), ("assign", 0, 0, 5), ("assign", 2, 60, 4)])
def test_full_p_equals_dense_attention(dtype, decoded, sinks, window, cluster_size):
    B, Hq, Hkv, D, S = 2, 6, 2, 24, 71
    cache = make_cache(B, Hkv, S, D, dtype, seed=sinks + window, offset=2.0)
    policy = DoubleP(DoublePOptions(p1=1.0, p2=1.0, sinks=sinks, window=window, cluster_size=cluster_size,
                                    decoded=decoded, dense_layers=0))
    lengths = [47, 59]
    policy.build(0, cache, lengths)
    g = torch.Generator().manual_seed(7)
    for steps in (0, 3, 6):
        lengths = grow(policy, cache, lengths, steps)
        positions = torch.tensor(lengths)
        q = (torch.randn(B, Hq, 1, D, generator=g) * 1.5).to(dtype)
        out = policy.decode(0, q, cache, positions)
        assert out.dtype == dtype and out.shape == (B, Hq, 1, D)
        ref = dense_reference(q, cache, positions)
        assert torch.allclose(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype]), \
            (out.float() - ref.float()).abs().max()
        stats = policy.last_stats
        assert stats["centroid_terms"].sum() == 0
        assert torch.equal(stats["exact_tokens"], (positions + 1)[:, None].expand(B, Hkv))


# ---------------------------------------------------------------------------------------------- merged softmax

def naive_merged(q, exact_k, exact_v, exact_valid, cent_logit, cent_size, cent_vsum, cent_valid):
    """float64, one softmax over a written-out term list: tokens (q·k/√D, v) and centroids (x + log s, VΣ / s)."""
    B, Hq, _, D = q.shape
    Hkv = exact_k.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b, h in itertools.product(range(B), range(Hq)):
        kv = h // (Hq // Hkv)
        logits, values = [], []
        for j in range(exact_k.shape[2]):
            if exact_valid[b, kv, j]:
                logits.append(q[b, h, 0].double() @ exact_k[b, kv, j].double() / D**0.5)
                values.append(exact_v[b, kv, j].double())
        for i in range(cent_logit.shape[-1]):
            if cent_valid[b, kv, i]:
                s = cent_size[b, kv, i].double()
                logits.append(cent_logit[b, h, i].double() + s.log())
                values.append(cent_vsum[b, kv, i].double() / s)
        w = torch.stack(logits).softmax(0)
        out[b, h] = (w[:, None] * torch.stack(values)).sum(0)
    return out[:, :, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_merged_attention_equals_naive_term_list(dtype, scale):
    g = torch.Generator().manual_seed(int(scale))
    B, Hq, Hkv, D, M, C = 2, 6, 2, 24, 13, 9
    q = (torch.randn(B, Hq, 1, D, generator=g) * scale).to(dtype)
    exact_k = torch.randn(B, Hkv, M, D, generator=g).to(dtype)
    exact_v = torch.randn(B, Hkv, M, D, generator=g).to(dtype)
    exact_valid = torch.rand(B, Hkv, M, generator=g) > 0.3
    exact_valid[..., 0] = True
    cent_logit = torch.randn(B, Hq, C, generator=g) * 5 * scale  # |x| up to ~1000 at scale 40
    size = torch.randint(1, 40, (B, Hkv, C), generator=g)
    cent_vsum = torch.randn(B, Hkv, C, D, generator=g) * size[..., None]
    cent_valid = torch.rand(B, Hkv, C, generator=g) > 0.4
    out = merged_attention(q, exact_k, exact_v, exact_valid, cent_logit, size.float().log(), cent_vsum, cent_valid)
    assert out.dtype == dtype and out.shape == (B, Hq, 1, D) and torch.isfinite(out).all()
    ref = naive_merged(q, exact_k, exact_v, exact_valid, cent_logit, size, cent_vsum, cent_valid)
    tol = TOL[dtype] if scale == 1.0 else max(TOL[dtype], 2e-3)  # fp32 q·k of size ~1e3 carries ~1e-4 error
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()
    # per-query-head log sizes give the same result
    per_head = size.float().log().repeat_interleave(Hq // Hkv, dim=1)
    same = merged_attention(q, exact_k, exact_v, exact_valid, cent_logit, per_head, cent_vsum, cent_valid)
    assert torch.equal(same, out)


@pytest.mark.parametrize("dtype,D,G", [(torch.float32, 64, 3), (torch.bfloat16, 128, 4), (torch.float16, 64, 1)])
def test_sparse_merged_attention_equals_the_reference(dtype, D, G):
    """The CUDA path (valid slots compacted, Triton's sparse attention with the centroid terms as one more split;
    here through Triton's interpreter) against `merged_attention` over gathered K/V: valid slots scattered through
    the list, a head group with no centroid term, one with no exact slot, one with neither."""
    g = torch.Generator().manual_seed(D + G)
    B, Hkv, S, M, C = 3, 2, 97, 41, 11
    Hq = Hkv * G
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    slots = torch.rand(B, Hkv, S, generator=g).argsort(-1)[..., :M]  # distinct slots
    valid = torch.rand(B, Hkv, M, generator=g) > 0.4
    valid[1, 0] = False  # no exact slot
    valid[2, 1] = False
    slots = slots.masked_fill(~valid, 0)
    cent_logit = torch.randn(B, Hq, C, generator=g) * 3
    size = torch.randint(1, 30, (B, Hkv, C), generator=g)
    cent_vsum = torch.randn(B, Hkv, C, D, generator=g) * size[..., None]
    approx = torch.rand(B, Hkv, C, generator=g) > 0.5
    approx[0, 1] = False  # no centroid term
    approx[2, 1] = False  # neither: zeros
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel: compiled on CUDA, interpreted on CPU
    k, v, q, slots, valid, cent_logit, size, cent_vsum, approx = (
        t.to(dev) for t in (k, v, q, slots, valid, cent_logit, size, cent_vsum, approx))
    gather = lambda x: x.gather(2, slots[..., None].expand(-1, -1, -1, D))  # noqa: E731
    ref = merged_attention(q, gather(k), gather(v), valid, cent_logit, size.float().log(), cent_vsum, approx)
    out = merged_attention_sparse(q, k, v, slots, valid, cent_logit, size.float().log(), cent_vsum, approx)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    assert (out[2, G:2 * G] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cluster_of_identical_keys_is_exact_as_a_centroid_term(dtype):
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, D, M, n = 2, 6, 2, 24, 7, 11
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    exact_k = torch.randn(B, Hkv, M, D, generator=g).to(dtype)
    exact_v = torch.randn(B, Hkv, M, D, generator=g).to(dtype)
    key = (torch.randn(B, Hkv, 1, D, generator=g) * 2).to(dtype)
    members_v = torch.randn(B, Hkv, n, D, generator=g).to(dtype)
    all_k = torch.cat([exact_k, key.expand(-1, -1, n, -1)], 2)
    all_v = torch.cat([exact_v, members_v], 2)
    ref = dense_attention(q.float(), all_k.float(), all_v.float(), torch.ones(B, 1, 1, M + n, dtype=torch.bool))
    x = (q.float().view(B, Hkv, Hq // Hkv, D) @ key.float().transpose(-1, -2)).view(B, Hq, 1) / D**0.5
    out = merged_attention(q, exact_k, exact_v, torch.ones(B, Hkv, M, dtype=torch.bool), x,
                           torch.full((B, Hkv, 1), float(n)).log(), members_v.float().sum(2, keepdim=True),
                           torch.ones(B, Hkv, 1, dtype=torch.bool))
    assert torch.allclose(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype]), (out.float() - ref).abs().max()


def test_merged_attention_with_nothing_valid_is_zero():
    q = torch.randn(1, 2, 1, 8)
    out = merged_attention(q, torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8), torch.zeros(1, 1, 3, dtype=torch.bool),
                           torch.randn(1, 2, 2), torch.zeros(1, 1, 2), torch.randn(1, 1, 2, 8),
                           torch.zeros(1, 1, 2, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


# ---------------------------------------------------------------------------------------------- k-means

def objective(x, centroids, assign):
    return (x - centroids.gather(1, assign[..., None].expand(-1, -1, x.shape[-1]))).pow(2).sum().item()


def test_kmeans_is_seeded_assigns_every_point_and_never_worsens():
    g = torch.Generator().manual_seed(0)
    G, N, D, k = 3, 157, 12, 10
    x = torch.randn(G, N, D, generator=g) + 4 * torch.randn(G, 1, D, generator=g)
    c1, a1 = kmeans(x, k, 6, torch.Generator().manual_seed(5))
    c2, a2 = kmeans(x, k, 6, torch.Generator().manual_seed(5))
    assert torch.equal(c1, c2) and torch.equal(a1, a2)
    c3, _ = kmeans(x, k, 6, torch.Generator().manual_seed(6))
    assert not torch.equal(c1, c3)
    assert a1.shape == (G, N) and a1.dtype == torch.long and ((a1 >= 0) & (a1 < k)).all()
    # the centroids are the means of the returned clusters
    sums, sizes = cluster_sums(x, a1, k)
    nonempty = sizes > 0
    assert torch.allclose(c1[nonempty], (sums / sizes.clamp_min(1)[..., None])[nonempty], atol=1e-5)
    # Lloyd: the objective never increases from one iteration to the next
    costs = [objective(x, *kmeans(x, k, t, torch.Generator().manual_seed(5))) for t in range(1, 9)]
    assert all(b <= a * (1 + 1e-6) for a, b in itertools.pairwise(costs)), costs
    assert costs[-1] < costs[0]


@pytest.mark.parametrize("precision", ["ieee", "tf32", "bf16"])
def test_kmeans_on_a_sample_and_in_rounded_precision_stays_close_to_the_full_one(precision):
    """sample = 1 is the plain k-means; with a quarter of the points in the iterations but the last, and tf32 / bf16
    dot products, it is still k-means: the centroids the means of the clusters, most of the full run's gain kept."""
    g = torch.Generator().manual_seed(3)
    G, N, D, k = 2, 800, 16, 40
    x = (torch.randn(G, k, D, generator=g) * 4).repeat_interleave(N // k, 1) + torch.randn(G, N, D, generator=g)
    x = x + 30  # far from the origin, as keys are
    full = kmeans(x, k, 4, torch.Generator().manual_seed(5))
    same = kmeans(x, k, 4, torch.Generator().manual_seed(5), sample=1.0, precision="ieee")
    assert torch.equal(full[0], same[0]) and torch.equal(full[1], same[1])
    c, a = kmeans(x, k, 4, torch.Generator().manual_seed(5), sample=0.25, precision=precision)
    assert a.shape == (G, N) and ((a >= 0) & (a < k)).all()
    sums, sizes = cluster_sums(x, a, k)
    nonempty = sizes > 0
    assert torch.allclose(c[nonempty], (sums / sizes.clamp_min(1)[..., None])[nonempty], atol=1e-4)
    # the sampled iterations help (a plain single assignment is far worse) and cost some of the full ones' gain
    assert objective(x, c, a) < 0.8 * objective(x, *kmeans(x, k, 1, torch.Generator().manual_seed(5)))
    assert objective(x, c, a) <= 1.25 * objective(x, *full)


def test_rounding_to_tf32_and_bf16_keeps_the_nearest_mantissa():
    from sparsespec.attention.doublep import _rounded_to

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 100
    for name, bits in (("tf32", 10), ("bf16", 7)):
        r = _rounded_to(x, name)
        assert (r.view(torch.int32) & ((1 << (23 - bits)) - 1) == 0).all()  # the dropped bits are zero
        ulp = 2.0 ** (torch.floor(torch.log2(x.abs().double())) - bits)  # the kept mantissa's unit
        assert ((r.double() - x.double()).abs() <= ulp / 2).all()  # to nearest
    assert torch.equal(_rounded_to(x, "ieee"), x)


def assert_nearest(got, points, centroids, valid=None, min_clear=0.9):
    """got [G, N] is a nearest centroid of each point: its float64 squared distance is the minimum up to fp32
    rounding (which way a near-tie goes depends on the BLAS), and where the nearest is clear it is that one.
    min_clear: the least share of points whose nearest is clear (so that the index check bites)."""
    d = torch.cdist(points.double(), centroids.double()).square()  # [G, N, k]
    if valid is not None:
        d = d.masked_fill(~valid[:, None], float("inf"))
    norms = points.double().square().sum(-1).amax(-1) + 2 * centroids.double().square().sum(-1).amax(-1)  # [G]
    tol = 1e-4 * norms[:, None]  # above any fp32 rounding of the distances (≲ D·eps of the norms), below real gaps
    two = d.topk(2, -1, largest=False).values
    chosen = d.gather(-1, got[..., None])[..., 0]
    assert torch.isfinite(chosen).all()  # never an invalid centroid
    assert (chosen <= two[..., 0] + tol).all(), (chosen - two[..., 0]).max()
    clear = two[..., 1] - two[..., 0] > 2 * tol
    assert clear.float().mean() >= min_clear
    assert torch.equal(got[clear], d.argmin(-1)[clear])


def test_kmeans_empty_clusters_and_nearest_matches_cdist():
    g = torch.Generator().manual_seed(1)
    # two distinct points repeated: k = 4 distinct initial slots hold duplicate keys, so some initial centroids
    # coincide (exact ties, broken to the lowest index whatever the BLAS) and clusters empty out
    x = torch.randn(2, 2, 7, generator=g).repeat_interleave(15, dim=1)  # [2, 30, 7]
    centroids, assign = kmeans(x, 4, 5, torch.Generator().manual_seed(0))
    assert torch.isfinite(centroids).all() and ((assign >= 0) & (assign < 4)).all()
    assert objective(x, centroids, assign) < 1e-8
    _, sizes = cluster_sums(x, assign, 4)
    assert ((sizes > 0).sum(-1) == 2).all()  # each point's 15 copies in one cluster
    # k = N: every point is its own cluster
    y = torch.randn(2, 9, 7, generator=g)
    centroids, assign = kmeans(y, 9, 3, torch.Generator().manual_seed(0))
    assert objective(y, centroids, assign) < 1e-8 and all(len(set(a.tolist())) == 9 for a in assign)
    x = torch.randn(2, 90, 7, generator=g) * 3
    cents = torch.randn(2, 6, 7, generator=g)
    assert_nearest(nearest(x, cents), x, cents)
    valid = torch.tensor([[True, False, True, False, True, True]] * 2)
    assert_nearest(nearest(x, cents, valid), x, cents, valid)
    # a wrong choice is caught: the farthest valid centroid
    far = torch.cdist(x, cents).masked_fill(~valid[:, None], -1.0).argmax(-1)
    with pytest.raises(AssertionError):
        assert_nearest(far, x, cents, valid)
    with pytest.raises(AssertionError):  # and an invalid one, however near
        assert_nearest(nearest(x, cents), x, cents, valid)


def test_nearest_breaks_ties_to_the_lowest_index():
    """Duplicate centroids and centroids one ulp apart are ties: the lowest index wins, for every point (rows of
    the matmul round differently per BLAS and per position, so a plain argmax splits identical points)."""
    g = torch.Generator().manual_seed(3)
    G, k, D, n = 2, 12, 24, 20
    cents = torch.randn(G, k, D, generator=g) * 2 + 5
    groups = [[1, 6, 10], [3, 4], [0, 11]]
    for grp in groups:
        cents[:, grp[1:]] = cents[:, grp[:1]]
    cents[:, 7] = torch.nextafter(cents[:, 8], torch.full_like(cents[:, 8], float("inf")))  # 8 is the point itself
    groups.append([7, 8])
    points = torch.cat([cents[:, grp[-1:]].expand(-1, n, -1) for grp in groups], 1)  # each = the last of its group
    got = nearest(points, cents)
    assert torch.equal(got, torch.tensor([min(grp) for grp in groups]).repeat_interleave(n).expand(G, -1))
    # masked: the lowest valid index of the group
    valid = torch.ones(G, k, dtype=torch.bool)
    valid[:, [1, 3, 7]] = False
    got = nearest(points, cents, valid)
    assert torch.equal(got, torch.tensor([6, 4, 0, 8]).repeat_interleave(n).expand(G, -1))


def test_cluster_layout_groups_each_clusters_members():
    cache = make_cache(2, 2, 80, 16, seed=4)
    policy = DoubleP(DoublePOptions(sinks=3, window=6, cluster_size=5, dense_layers=0))
    lengths = [61, 77]
    policy.build(0, cache, lengths)
    st = cache.policy_state[0]
    for b, n in enumerate(lengths):
        end = n - 6
        assert st.prefill_end[b] == st.clustered_end[b] == end
        k = -(-(end - 3) // 5)
        for h in range(2):
            assign = st.assign[b, h]
            assert (assign[:3] == -1).all() and (assign[end:] == -1).all() and (assign[3:end] >= 0).all()
            assert (assign[3:end] < k).all() and (st.size[b, h, k:] == 0).all()
            for c in range(k):
                members = st.perm[b, h, st.offsets[b, h, c]:st.offsets[b, h, c + 1]]
                assert set(members.tolist()) == set((torch.nonzero(assign == c).flatten()).tolist())
                assert st.size[b, h, c] == len(members)
                if len(members):
                    vsum = cache.v[0][b, h, members].sum(0)
                    assert torch.allclose(st.value_sum[b, h, c], vsum, atol=1e-5)
                    assert torch.allclose(st.centroids[b, h, c], cache.k[0][b, h, members].mean(0), atol=1e-5)
    # csr_members gathers exactly the chosen clusters' members
    chosen = torch.rand(st.size.shape, generator=torch.Generator().manual_seed(0)) > 0.5
    slots, valid = csr_members(st.perm, st.offsets, chosen)
    for b, h in itertools.product(range(2), range(2)):
        got = slots[b, h][valid[b, h]].tolist()
        assert len(got) == len(set(got))
        expected = {s for s in range(80) if st.assign[b, h, s] >= 0 and chosen[b, h, st.assign[b, h, s]]}
        assert set(got) == expected


# ---------------------------------------------------------------------------------------------- the two stages

def brute_force_top_p(mass, valid, base, target):
    """The smallest set of valid clusters reaching target (None if none does), by enumeration; ties impossible."""
    ids = [i for i in range(len(mass)) if valid[i]]
    for r in range(len(ids) + 1):
        best = max(itertools.combinations(ids, r), key=lambda s: sum(mass[i] for i in s))
        if base + sum(mass[i] for i in best) >= target:
            return set(best)
    return set(ids)


@pytest.mark.parametrize("seed", range(6))
def test_top_p_prefix_is_the_smallest_set_reaching_p(seed):
    g = torch.Generator().manual_seed(seed)
    R, C = 20, 7
    raw = torch.rand(R, C + 1, generator=g) ** 3
    raw = raw / raw.sum(-1, keepdim=True)
    base, mass = raw[:, 0], raw[:, 1:]
    valid = torch.rand(R, C, generator=g) > 0.2
    for p in (0.3, 0.7, 0.95, 1.0):
        got = top_p_prefix(mass, valid, base, p)
        for r in range(R):
            expected = brute_force_top_p(mass[r].tolist(), valid[r].tolist(), base[r].item(), p)
            if p == 1.0:  # p = 1 takes every valid cluster, whatever the rounding of the sums
                expected = set(torch.nonzero(valid[r]).flatten().tolist())
            assert set(torch.nonzero(got[r]).flatten().tolist()) == expected, (p, r)
    total = torch.rand(R, generator=g)  # a relative target: p · total
    got = top_p_prefix(mass, valid, base, 0.6, total)
    for r in range(R):
        expected = brute_force_top_p(mass[r].tolist(), valid[r].tolist(), base[r].item(), 0.6 * total[r].item())
        assert set(torch.nonzero(got[r]).flatten().tolist()) == expected


def reference_masses(q, cache, st, positions, sinks, spread=False):
    """float64 per query head softmax over kept tokens' logits and cluster log-weights, averaged over the group;
    spread: each cluster's log-weight gains ½ Σ_d q_d² var_d / D, var from its members' keys read from the cache."""
    B, Hq, _, D = q.shape
    Hkv = cache.k[0].shape[1]
    G = Hq // Hkv
    kept_mass = torch.zeros(B, Hkv, dtype=torch.float64)
    mass = torch.zeros(st.size.shape, dtype=torch.float64)
    for b in range(B):
        p, e = int(positions[b]), st.clustered_end[b]
        kept = [s for s in range(p + 1) if s < sinks or s >= e]
        for h in range(Hq):
            kv = h // G
            qh = q[b, h, 0].double()
            lk = cache.k[0][b, kv, kept].double() @ qh / D**0.5
            size = st.size[b, kv].double()
            lc = st.centroids[b, kv].double() @ qh / D**0.5 + size.log()
            if spread:
                for c in range(len(size)):
                    members = (st.assign[b, kv] == c).nonzero().flatten()
                    if len(members):
                        var = cache.k[0][b, kv, members].double().var(0, unbiased=False)
                        lc[c] += 0.5 * (qh.square() * var).sum() / D
            w = torch.cat([lk, lc]).softmax(0)
            kept_mass[b, kv] += w[:len(kept)].sum() / G
            mass[b, kv] += w[len(kept):] / G
    return kept_mass, mass


@pytest.mark.parametrize("p2_of,tail,estimate", [("total", "approx", "centroid"), ("selected", "approx", "centroid"),
                                                  ("total", "drop", "centroid"), ("total", "approx", "spread")])
def test_stages_select_the_brute_force_sets(p2_of, tail, estimate):
    B, Hq, Hkv, D, S = 2, 6, 2, 24, 140
    cache = make_cache(B, Hkv, S, D, seed=11, offset=1.0)
    opts = DoublePOptions(p1=0.8, p2=0.5, sinks=3, window=9, cluster_size=6, p2_of=p2_of, tail=tail, dense_layers=0,
                          estimate=estimate)
    policy = DoubleP(opts)
    lengths = [97, 123]
    policy.build(0, cache, lengths)
    lengths = grow(policy, cache, lengths, 12)
    positions = torch.tensor(lengths)
    g = torch.Generator().manual_seed(2)
    st = cache.policy_state[0]
    for _ in range(3):
        q = torch.randn(B, Hq, 1, D, generator=g) * 3
        plan = policy.plan(0, q, cache, positions)
        kept_mass, mass = reference_masses(q, cache, st, positions, sinks=3, spread=estimate == "spread")
        assert torch.allclose(plan.kept_mass.double(), kept_mass, atol=1e-5)
        assert torch.allclose(plan.mass.double(), mass, atol=1e-5)
        for b, h in itertools.product(range(B), range(Hkv)):
            m, valid, base = plan.mass[b, h].tolist(), (st.size[b, h] > 0).tolist(), plan.kept_mass[b, h].item()
            p1_set = brute_force_top_p(m, valid, base, opts.p1)
            assert set(torch.nonzero(plan.in_p1[b, h]).flatten().tolist()) == p1_set
            target = opts.p2 * (base + sum(m[i] for i in p1_set) if p2_of == "selected" else 1.0)
            in_p1 = [i in p1_set for i in range(len(m))]
            assert set(torch.nonzero(plan.exact[b, h]).flatten().tolist()) == brute_force_top_p(m, in_p1, base, target)
            approx = p1_set - set(torch.nonzero(plan.exact[b, h]).flatten().tolist()) if tail == "approx" else set()
            assert set(torch.nonzero(plan.approx[b, h]).flatten().tolist()) == approx
        _, stats = policy.decode_with_stats(0, q, cache, positions)
        every = plan.in_p1.sum(-1) == (st.size > 0).sum(-1)
        assert ((stats["p1_mass"] >= opts.p1 - 1e-6) | every).all()
        assert (stats["exact_tokens"] < positions[:, None] + 1).any()  # it is sparse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_the_merged_softmax_over_the_selected_slots_and_centroids(dtype):
    B, Hq, Hkv, D, S = 2, 6, 2, 24, 120
    cache = make_cache(B, Hkv, S, D, dtype, seed=5, offset=1.0)
    policy = DoubleP(DoublePOptions(p1=0.9, p2=0.6, sinks=2, window=7, cluster_size=5, dense_layers=0))
    lengths = [83, 101]
    policy.build(0, cache, lengths)
    lengths = grow(policy, cache, lengths, 9)
    positions = torch.tensor(lengths)
    st = cache.policy_state[0]
    q = (torch.randn(B, Hq, 1, D, generator=torch.Generator().manual_seed(9)) * 3).to(dtype)
    out, stats = policy.decode_with_stats(0, q, cache, positions)
    plan = policy.plan(0, q, cache, positions)
    exact, approx = policy.selected_slots(0, q, cache, positions)
    assert not (exact & approx).any()
    assert torch.equal(exact.sum(-1), stats["exact_tokens"]) and (stats["centroid_terms"] > 0).any()
    for b, h in itertools.product(range(B), range(Hkv)):  # exact = kept tokens + members of exact clusters
        p, e = lengths[b], st.clustered_end[b]
        for s in range(p + 1):
            c = int(st.assign[b, h, s])
            assert bool(exact[b, h, s]) == (s < 2 or s >= e or bool(plan.exact[b, h, c])), (b, h, s)
            assert bool(approx[b, h, s]) == (c >= 0 and bool(plan.approx[b, h, c]))
    kv_len = int(positions.max()) + 1
    ref = naive_merged(q, cache.k[0][:, :, :kv_len], cache.v[0][:, :, :kv_len], exact,
                       plan.logits.reshape(B, Hq, -1), st.size.clamp_min(1), st.value_sum, plan.approx)
    assert torch.allclose(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype]), (out.double() - ref).abs().max()


# ---------------------------------------------------------------------------------------------- decoded tokens

def assert_matches_recomputation(st, cache, sinks):
    k, v = cache.k[0].float(), cache.v[0].float()
    B, Hkv, C = st.size.shape
    for b, h in itertools.product(range(B), range(Hkv)):
        end, assign = st.clustered_end[b], st.assign[b, h]
        assert (assign[:sinks] == -1).all() and (assign[end:] == -1).all() and (assign[sinks:end] >= 0).all()
        idx = assign[sinks:end]
        size = torch.bincount(idx, minlength=C)
        key_sum = torch.zeros(C, k.shape[-1]).index_add_(0, idx, k[b, h, sinks:end])
        value_sum = torch.zeros(C, k.shape[-1]).index_add_(0, idx, v[b, h, sinks:end])
        assert torch.equal(st.size[b, h], size)
        assert torch.allclose(st.key_sum[b, h], key_sum, atol=1e-4)
        key_sq_sum = torch.zeros(C, k.shape[-1]).index_add_(0, idx, k[b, h, sinks:end].square())
        assert torch.allclose(st.key_sq_sum[b, h], key_sq_sum, atol=1e-3, rtol=1e-5)
        assert torch.allclose(st.value_sum[b, h], value_sum, atol=1e-4)
        nonempty = size > 0
        assert torch.allclose(st.centroids[b, h][nonempty], (key_sum / size.clamp_min(1)[:, None])[nonempty],
                              atol=1e-5)


def test_decoded_tokens_join_the_nearest_cluster_and_rollback_restores_the_state():
    sinks, window = 3, 5
    cache = make_cache(2, 2, 96, 20, seed=8, offset=1.5)
    policy = DoubleP(DoublePOptions(sinks=sinks, window=window, cluster_size=4, dense_layers=0))
    lengths = [50, 63]
    policy.build(0, cache, lengths)
    st = cache.policy_state[0]
    before = st.centroids.clone()
    valid = st.size > 0
    lengths = grow(policy, cache, lengths, 1)  # one token per row leaves the window
    slots = [n - window - 1 for n in lengths]
    assert st.clustered_end == [n - window for n in lengths]
    keys = torch.stack([cache.k[0][b, :, s] for b, s in enumerate(slots)])  # [B, Hkv, D]
    got = torch.stack([st.assign[b, :, s] for b, s in enumerate(slots)])  # [B, Hkv]
    assert_nearest(got.view(-1, 1), keys.flatten(0, 1)[:, None], before.flatten(0, 1), valid.flatten(0, 1),
                   min_clear=0)
    assert_matches_recomputation(st, cache, sinks)
    lengths = grow(policy, cache, lengths, 7)
    assert_matches_recomputation(st, cache, sinks)
    snapshot, at = clone_state(st), list(lengths)
    policy.append(0, cache, [n + 6 for n in lengths])  # a multi-token commit
    assert_matches_recomputation(st, cache, sinks)
    assert not torch.allclose(st.centroids, snapshot["centroids"])
    policy.append(0, cache, at)  # roll back
    for name, value in snapshot.items():
        if name == "clustered_end":
            assert st.clustered_end == value
        elif value.dtype == torch.long:
            assert torch.equal(getattr(st, name), value), name
        else:
            assert torch.allclose(getattr(st, name), value, atol=1e-5), name
    # regrow after the rollback with different tokens, then roll back below the prefill length
    for b, n in enumerate(at):
        cache.k[0][b, :, n:].normal_()
    policy.append(0, cache, [n + 12 for n in at])
    assert_matches_recomputation(st, cache, sinks)
    policy.append(0, cache, [40, 41])
    assert st.clustered_end == [40 - window, 41 - window]
    assert_matches_recomputation(st, cache, sinks)
    q = torch.randn(2, 4, 1, 20)
    positions = torch.tensor([40, 41])
    full = DoubleP(DoublePOptions(p1=1.0, p2=1.0, sinks=sinks, window=window, dense_layers=0))
    assert torch.allclose(full.decode(0, q, cache, positions), dense_reference(q, cache, positions), atol=1e-5)


def test_window_mode_never_clusters_decoded_tokens():
    cache = make_cache(1, 2, 90, 16, seed=2)
    policy = DoubleP(DoublePOptions(sinks=4, window=6, cluster_size=4, decoded="window", dense_layers=0))
    policy.build(0, cache, [60])
    st = cache.policy_state[0]
    snapshot = clone_state(st)
    grow(policy, cache, [60], 20)
    assert st.clustered_end == [54]
    assert torch.equal(st.assign, snapshot["assign"]) and torch.equal(st.size, snapshot["size"])
    q = torch.randn(1, 4, 1, 16)
    _, stats = policy.decode_with_stats(0, q, cache, torch.tensor([80]))
    assert (stats["exact_tokens"] >= 4 + 80 - 54 + 1).all()  # sinks + growing window + current token


# ---------------------------------------------------------------------------------------------- options

@pytest.mark.parametrize("bad", [
    {"p1": 0.0}, {"p1": 1.2}, {"p2": 0.0}, {"p1": 0.6, "p2": 0.7}, {"p2_of": "all"}, {"tail": "keep"},
    {"decoded": "never"}, {"recluster_every": 0}, {"cluster_size": 0}, {"kmeans_iters": 0}, {"window": -1},
    {"sinks": -2}, {"index_dtype": "float16"}])
def test_invalid_options_are_rejected(bad):
    with pytest.raises(SparseSpecError):
        DoublePOptions(**bad)


def test_options_parse_from_strings():
    opts = parse_options(DoublePOptions, ["p1=0.9", "p2=0.5", "p2_of=selected", "tail=drop", "decoded=window",
                                          "cluster_size=32"])
    assert (opts.p1, opts.p2, opts.p2_of, opts.tail, opts.decoded, opts.cluster_size) == (
        0.9, 0.5, "selected", "drop", "window", 32)
    defaults = DoublePOptions()
    assert (defaults.sinks, defaults.window, defaults.p1, defaults.p2, defaults.cluster_size) == (4, 64, 0.99, 0.9, 8)
    with pytest.raises(SparseSpecError):
        parse_options(DoublePOptions, ["p2=0.995"])  # above the default p1


def test_recluster_equals_a_fresh_build_on_the_longer_cache():
    from sparsespec.attention.doublep import DoubleP, DoublePOptions

    from .conftest import cache_with_keys

    g = torch.Generator().manual_seed(11)
    cache = cache_with_keys(torch.randn(1, 2, 120, 8, generator=g))
    opts = DoublePOptions(dense_layers=0, sinks=2, window=10, cluster_size=8, decoded="recluster", recluster_every=5)
    policy = DoubleP(opts)
    policy.build(0, cache, [60])
    for n in range(61, 64):  # 3 tokens join: below recluster_every, plain assignment
        policy.append(0, cache, [n])
    assert cache.policy_state[0].prefill_end == [50]
    for n in range(64, 70):  # the 5th joined token triggers a fresh clustering
        policy.append(0, cache, [n])
    reclustered = cache.policy_state[0]
    assert reclustered.prefill_end == [55]
    fresh = DoubleP(opts)
    fresh_cache = cache_with_keys(cache.k[0].clone())
    fresh_cache.v[0].copy_(cache.v[0])
    fresh.build(0, fresh_cache, [65])  # the clustering the 5th joined token (n = 65) triggered ...
    for n in range(66, 70):  # ... then 4 more tokens joined by assignment
        fresh.append(0, fresh_cache, [n])
    expected = fresh_cache.policy_state[0]
    assert torch.equal(reclustered.size, expected.size)
    torch.testing.assert_close(reclustered.centroids, expected.centroids)
    assert reclustered.clustered_end == expected.clustered_end == [59]
    assert torch.equal(reclustered.assign, expected.assign)


@pytest.mark.parametrize("seed", range(4))
def test_rollback_below_prefill_then_regrowth_keeps_each_token_in_one_place(seed):
    from sparsespec.attention.doublep import DoubleP, DoublePOptions

    from .conftest import cache_with_keys

    g = torch.Generator().manual_seed(seed)
    cache = cache_with_keys(torch.randn(1, 2, 90, 8, generator=g))
    policy = DoubleP(DoublePOptions(dense_layers=0, sinks=2, window=6, cluster_size=4, p1=1.0, p2=0.5))
    policy.build(0, cache, [60])
    policy.append(0, cache, [45])  # roll back below the prefill clustering (ends at 54)
    cache.k[0][:, :, 45:70] = torch.randn(1, 2, 25, 8, generator=g)  # new tokens overwrite the dead slots
    cache.v[0][:, :, 45:70] = torch.randn(1, 2, 25, 8, generator=g)
    for n in range(46, 71):
        policy.append(0, cache, [n])
    q = torch.randn(1, 4, 1, 8, generator=g)
    exact, approx = policy.selected_slots(0, q, cache, torch.tensor([70]))
    st = cache.policy_state[0]
    clustered = st.assign[0, :, :71] >= 0  # [Hkv, S]
    for h in range(2):
        assert not (exact[0, h] & approx[0, h]).any()
        # every clustered slot is either attended exactly or approximated (p1 = 1 keeps every cluster)
        assert torch.equal((exact[0, h] | approx[0, h])[clustered[h]], torch.ones(int(clustered[h].sum()),
                                                                                  dtype=torch.bool))
    out = policy.decode(0, q, cache, torch.tensor([70]))
    assert torch.isfinite(out).all()


def test_spread_estimate_finds_a_needle_the_centroid_estimate_misses():
    """Four well-separated clusters of 16 keys; one of them holds a single key aligned with the query (the needle)
    among keys pointing away from it. The size-weighted centroid ranks that cluster below the others and leaves
    the needle out of the exact set; the spread estimate sees the cluster's variance along q and attends it."""
    D, n, S = 16, 16, 2 + 4 * 16 + 2
    g = torch.Generator().manual_seed(0)
    e = torch.eye(D)
    clusters = [10 * e[c] + 0.05 * torch.randn(n, D, generator=g) for c in (1, 2, 3)]
    hidden = 10 * e[4] - 0.5 * e[0] + 0.05 * torch.randn(n, D, generator=g)
    hidden[5] += 4 * e[0]  # the needle: q·k/√D = 8 · 3.5 / 4 = 7, the others -1
    cache = make_cache(1, 1, S, D)
    cache.k[0][0, 0] = torch.cat([torch.zeros(2, D), *clusters, hidden, torch.zeros(2, D)])
    q = (8 * e[0]).reshape(1, 1, 1, D)
    needle = 2 + 3 * n + 5
    found = {}
    for estimate in ("centroid", "spread"):
        policy = DoubleP(DoublePOptions(p1=0.9, p2=0.5, sinks=2, window=2, cluster_size=n, estimate=estimate,
                                        dense_layers=0))
        policy.build(0, cache, [S])
        st = cache.policy_state[0]
        assert (st.assign[0, 0, 2 + 3 * n:2 + 4 * n] == st.assign[0, 0, needle]).all()  # k-means found the layout
        assert int(st.size[0, 0, st.assign[0, 0, needle]]) == n
        exact, _ = policy.selected_slots(0, q, cache, torch.tensor([S - 1]))
        found[estimate] = bool(exact[0, 0, needle])
    assert found == {"centroid": False, "spread": True}


def test_batched_build_gives_each_row_its_clustering_alone():
    """One k-means over every row and KV head (rows of different lengths, one with no candidates, NaN in the dead
    slots past the shorter rows): each row's clusters, members and layout are those of the row built alone."""
    B, Hkv, S, D = 3, 2, 120, 16
    cache = make_cache(B, Hkv, S, D, seed=4, offset=3.0)
    lengths = [118, 40, 10]  # the last: all sinks and window
    for b, n in enumerate(lengths):
        cache.k[0][b, :, n:] = float("nan")
        cache.v[0][b, :, n:] = float("inf")
    policy = DoubleP(DoublePOptions(sinks=2, window=8, cluster_size=8, kmeans_iters=4, dense_layers=0))
    policy.build(0, cache, lengths)
    st = cache.policy_state[0]
    for b, n in enumerate(lengths):
        alone = cache.rows(b, b + 1)
        policy.build(0, alone, [n])
        one = alone.policy_state[0]
        C, N = one.size.shape[-1], one.perm.shape[-1]
        assert torch.equal(st.size[b, :, :C], one.size[0]) and not st.size[b, :, C:].any()
        torch.testing.assert_close(st.centroids[b, :, :C][one.size[0] > 0], one.centroids[0][one.size[0] > 0])
        torch.testing.assert_close(st.value_sum[b, :, :C], one.value_sum[0])
        count = max(0, n - 8 - 2)
        assert torch.equal(st.perm[b, :, :count], one.perm[0, :, :count])
        assert torch.equal(st.offsets[b, :, :C + 1], one.offsets[0])
        assert torch.equal(st.assign[b], one.assign[0])
    for t in (st.centroids, st.key_sum, st.key_sq_sum, st.value_sum):
        assert torch.isfinite(t).all()


# ---------------------------------------------------------------------------------------------- fixed-width steps

def step_both(eager, fixed, caches, lengths, steps, gen, Hq):
    """`steps` decode steps of the eager policy (append after each step, as the engine's eager loop) and of the
    fixed-width one (plan once, clustering inside each step), each on its own copy of the cache; the outputs and
    the clustering state must agree at every step. -> the lengths after."""
    B = len(lengths)
    D = caches[0].k[0].shape[-1]
    for _ in range(steps):
        positions = torch.tensor(lengths)
        q = torch.randn(B, Hq, 1, D, generator=gen)
        with eager.stepping(lengths):
            want = eager.decode(0, q, caches[0], positions)
        fixed.begin_step(positions)
        got = fixed.decode(0, q, caches[1], positions)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
        lengths = [n + 1 for n in lengths]
        eager.append(0, caches[0], lengths)
    return lengths


@pytest.mark.parametrize("decoded,sinks,window,p,index", [
    ("assign", 3, 5, (0.9, 0.6), "auto"), ("window", 2, 4, (0.95, 0.7), "auto"), ("assign", 0, 0, (1.0, 1.0), "auto"),
    ("assign", 4, 9, (0.8, 0.8), "auto"), ("assign", 3, 5, (0.9, 0.6), "bfloat16")])
def test_fixed_width_steps_equal_eager_steps(decoded, sinks, window, p, index):
    """Static widths, device-side clustering of the token leaving the window, no host reads: the same outputs
    and the same clusters as eager steps over two rows of different lengths, then after a rollback (bf16
    centroids and variances too)."""
    opts = DoublePOptions(sinks=sinks, window=window, cluster_size=4, p1=p[0], p2=p[1], decoded=decoded,
                          dense_layers=0, exact_cap=1.0, index_dtype=index)
    caches = [make_cache(2, 2, 90, 16, seed=5, offset=1.0) for _ in range(2)]
    eager, fixed = DoubleP(opts), DoubleP(opts)
    lengths = [50, 37]
    for policy, cache in zip((eager, fixed), caches):
        policy.build(0, cache, lengths)
    fixed.plan_fixed(caches[1], lengths)
    gen = torch.Generator().manual_seed(3)
    lengths = step_both(eager, fixed, caches, lengths, 12, gen, 4)
    a, b = caches[0].policy_state[0], caches[1].policy_state[0]
    fixed.append(0, caches[1], lengths)  # what a rollback finds first: the device's progress
    assert b.clustered_end == a.clustered_end
    for name in ("size", "assign"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("centroids", "key_sum", "value_sum", "value_mean"):
        assert torch.allclose(getattr(a, name), getattr(b, name), atol=1e-5), name
    back = [n - 4 for n in lengths]  # roll back, then step on
    eager.append(0, caches[0], back)
    fixed.append(0, caches[1], back)
    lengths = step_both(eager, fixed, caches, back, 6, gen, 4)
    fixed.append(0, caches[1], lengths)  # brought up to the committed tokens (a step clusters at its start)
    snapshot = clone_state(b)
    far = torch.tensor([85, 85])  # a step far ahead (a CUDA graph's warm-up at the last slot) clusters nothing
    fixed.begin_step(far)
    fixed.decode(0, torch.randn(2, 4, 1, 16, generator=gen), caches[1], far)
    fixed.append(0, caches[1], lengths)
    for name, value in snapshot.items():
        assert (getattr(b, name) == value) if name == "clustered_end" else torch.equal(getattr(b, name), value), name


def test_full_p_fixed_width_steps_are_dense_attention():
    cache = make_cache(2, 2, 70, 16, seed=2)
    policy = DoubleP(DoublePOptions(p1=1.0, p2=1.0, sinks=2, window=3, cluster_size=5, dense_layers=0,
                                    exact_cap=0.01))  # p2 = 1: no cap
    policy.build(0, cache, [40, 55])
    policy.plan_fixed(cache, [40, 55])
    positions = torch.tensor([40, 55])
    q = torch.randn(2, 4, 1, 16)
    policy.begin_step(positions)
    assert torch.allclose(policy.decode(0, q, cache, positions), dense_reference(q, cache, positions), atol=1e-5)


def test_exact_cap_keeps_the_best_ranked_clusters_and_approximates_the_rest():
    exact = torch.tensor([[True, True, False, True, True]])
    mass = torch.tensor([[0.1, 0.4, 0.9, 0.3, 0.2]])
    members = torch.tensor([[5, 6, 1, 4, 3]])
    # by mass among the exact: 1 (6 members), 3 (4), 4 (3), 0 (5): a cap of 12 takes 1 and 3, not 4 (13 > 12)
    assert capped(exact, mass, members, 12).tolist() == [[False, True, False, True, False]]
    assert capped(exact, mass, members, 100).tolist() == exact.tolist()
    cache = make_cache(1, 2, 200, 16, seed=4)
    opts = dict(p1=0.99, p2=0.9, sinks=2, window=4, cluster_size=4, dense_layers=0)
    free = DoubleP(DoublePOptions(**opts, exact_cap=1.0))
    tight = DoubleP(DoublePOptions(**opts, exact_cap=20, min_tokens=0))
    q = torch.randn(1, 4, 1, 16) * 0.1  # flat attention: the exact set needs many members
    for policy in (free, tight):
        policy.build(0, cache, [190])
        policy.plan_fixed(cache, [190])
        policy.begin_step(torch.tensor([190]))
    st = cache.policy_state[0]
    a, b = (policy.select(st, q, cache.k[0], torch.tensor([190]), st.clustered_end_dev, st.csr_end_dev,
                          policy.fixed.kept_width, policy.fixed.decoded_width, policy.fixed.exact_cap)
            for policy in (free, tight))
    counts = st.offsets[..., 1:] - st.offsets[..., :-1]
    assert int((counts * a.exact).sum(-1).max()) > 20 >= int((counts * b.exact).sum(-1).max())
    assert bool((b.exact <= a.exact).all()) and bool(((a.exact & ~b.exact) <= b.approx).all())
    assert torch.equal(a.in_p1, b.in_p1)


@pytest.mark.parametrize("p1,p2", [(0.95, 0.7), (0.99, 0.9), (1.0, 0.5), (1.0, 1.0), (0.6, 0.6), (0.3, 0.1)])
@pytest.mark.parametrize("selected", [False, True])
@pytest.mark.parametrize("cap", [None, 0, 25, 10**6])
def test_one_ranking_selects_what_the_two_prefixes_and_the_cap_select(p1, p2, selected, cap):
    g = torch.Generator().manual_seed(int(p1 * 100 + p2 * 10) + (cap or 7))
    B, Hkv, C = 3, 2, 40
    mass = torch.rand(B, Hkv, C, generator=g).pow(4)
    mass[0, 0, :10] = mass[0, 0, 10]  # ties
    mass[1, 1] = 0.0  # every mass 0
    valid = torch.rand(B, Hkv, C, generator=g) > 0.2
    valid[2, 0] = False  # no cluster at all
    mass = mass * valid / (mass * valid).sum(-1, keepdim=True).clamp_min(1e-9) * 0.8
    base = torch.rand(B, Hkv, generator=g) * 0.3
    members = torch.randint(0, 9, (B, Hkv, C), generator=g)
    in_p1, wanted, exact = select_clusters(mass, valid, base, p1, p2, selected, members, cap)
    ref_p1 = top_p_prefix(mass, valid, base, p1)
    total = base + (mass * ref_p1).sum(-1) if selected else None
    ref_wanted = top_p_prefix(mass, ref_p1, base, p2, total)
    ref_exact = ref_wanted if cap is None else capped(ref_wanted, mass, members, cap)
    assert torch.equal(in_p1, ref_p1) and torch.equal(wanted, ref_wanted) and torch.equal(exact, ref_exact)


@pytest.mark.parametrize("clusters,programs", [(1, 256), (257, 256), (1000, 256), (4096, 256), (4096, 8),
                                               (96, 10_000)])
def test_split_matmul_equals_the_product(clusters, programs):
    """The centroid terms' numerator split over chunks of clusters (none, a few, many) equals the plain product
    (odd sizes, fp64)."""
    from sparsespec.attention.doublep import split_matmul

    gen = torch.Generator().manual_seed(clusters)
    w = torch.randn(2, 3, 4, clusters, generator=gen, dtype=torch.float64)
    x = torch.randn(2, 3, clusters, 7, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(split_matmul(w, x, programs), w @ x, rtol=1e-12, atol=1e-12)
