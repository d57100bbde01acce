"""Double-P's sort-free cluster selection kernels against their torch references (CPU: Triton's interpreter at
small, odd sizes; CUDA: compiled, larger sizes too), and the policy's fixed-width steps through them against its
sorted torch path."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sparsespec.attention.doublep import DoubleP, DoublePOptions, csr_members, select_clusters  # noqa: E402
from sparsespec.kernels.cluster_select import (  # noqa: E402
    APPROX, EXACT, IN_P1, append_exact_members, append_exact_members_ref, cluster_masses, cluster_masses_ref,
    kept_tokens, kept_tokens_ref, mark_clusters, mark_clusters_ref, thresholds_ref,
)

from .conftest import DEVICE  # noqa: E402

SIZES = [(1, 1, 1, 1), (3, 4, 37, 9), (4, 7, 150, 70), (2, 6, 257, 1)] + \
    ([(128, 4, 16384, 69)] if DEVICE == "cuda" else [])
# (p1, p2, cap): caps that bind, that do not, none left
SETTINGS = [(0.9, 0.6, 40), (0.99, 0.9, 10**6), (1.0, 1.0, 10**6), (0.5, 0.2, 3), (0.95, 0.7, 0), (0.99, 0.9, 150)]
CASES = [size + setting for size, setting in zip(SIZES * 2, SETTINGS)] + \
    ([SIZES[-1] + s for s in SETTINGS[1:]] if DEVICE == "cuda" else [])


def _inputs(R, G, C, W, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    ranked = torch.randn(R, G, C, generator=g) * scale
    size = torch.randint(0, 6, (R, C), generator=g)
    members = torch.randint(0, 9, (R, C), generator=g)
    kept = torch.randn(R, G, W, generator=g) * scale
    kept[0, :, W // 2 + 1:] = float("-inf")  # a row with fewer kept tokens
    return [t.to(DEVICE) for t in (ranked, size, members, kept)]


@pytest.mark.parametrize("B,Hkv,G,S,D,sinks,width", [(1, 1, 1, 8, 16, 4, 5), (3, 2, 4, 90, 32, 3, 20),
                                                      (2, 3, 7, 200, 64, 0, 70)]
                         + ([(16, 8, 4, 4096, 128, 4, 69)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_tokens_equal_reference(B, Hkv, G, S, D, sinks, width, dtype):
    """Sinks and the unclustered tail up to the query: the same slots at the front of the list, counts and logits
    as the torch path, rows whose tail is longer than the width cut to it."""
    g = torch.Generator().manual_seed(S + width)
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype).to(DEVICE)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype).to(DEVICE)
    positions = torch.randint(0, S, (B,), generator=g)
    ends = (positions - torch.randint(-2, width + 3, (B,), generator=g)).clamp(sinks, S).to(DEVICE)
    idx = torch.randint(0, 9, (B * Hkv, width + 5), generator=g).int().to(DEVICE)
    got_idx, ref_idx = idx.clone(), idx.clone()
    logits, count = kept_tokens(q, k, positions.to(DEVICE), ends, sinks, width, got_idx)
    ref_logits, ref_count = kept_tokens_ref(q, k, positions.to(DEVICE), ends, sinks, width, ref_idx)
    assert torch.equal(count, ref_count) and torch.equal(got_idx, ref_idx)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def _sets(mass, thr, valid):
    u = (mass.view(torch.int32) >> 16).long()
    return [valid & (u >= thr[:, j:j + 1]) for j in range(3)]


@pytest.mark.parametrize("R,G,C,W,p1,p2,cap", CASES)
def test_masses_and_thresholds_equal_reference(R, G, C, W, p1, p2, cap):
    """Masses as the reference's softmax; the three sets from the kernel's thresholds as the reference's sort finds
    them on the same masses, and (no two masses equal here) as the sorted prefixes of the torch path."""
    ranked, size, members, kept = _inputs(R, G, C, W, R + C + int(p1 * 100))
    mass, kmass, thr = cluster_masses(ranked, size, members, kept, p1, p2, cap, block=64)
    ref_mass, ref_kept, _ = cluster_masses_ref(ranked, size, members, kept, p1, p2, cap)
    torch.testing.assert_close(mass, ref_mass, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(kmass, ref_kept, atol=1e-6, rtol=1e-4)
    valid = size > 0
    got = _sets(mass, thr, valid)
    want = _sets(mass, thresholds_ref(mass, kmass, valid, members, p1, p2, cap), valid)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert ((members * got[2]).sum(-1) <= cap).all()
    if C > 64:  # the masses read back a block at a time: the same thresholds
        assert torch.equal(cluster_masses(ranked, size, members, kept, p1, p2, cap, block=64, block_t=64)[2], thr)
    classes = mass.view(torch.int32) >> 16
    if torch.unique(classes[valid]).numel() == int(valid.sum()):  # one cluster a class: the sorted prefixes
        sorted_sets = select_clusters(mass, valid, kmass, p1, p2, False, members, cap)
        for a, b in zip(got, sorted_sets):
            assert torch.equal(a, b)


def test_equal_masses_are_taken_together_and_the_cap_holds():
    """Clusters of equal mass form one class: a p-set takes all of a class or none; the cap takes whole classes
    while their members fit."""
    ranked = torch.zeros(1, 2, 10, device=DEVICE)  # every cluster the same mass
    size = torch.ones(1, 10, dtype=torch.long, device=DEVICE)
    members = torch.full((1, 10), 3, device=DEVICE)
    kept = torch.full((1, 2, 1), float("-inf"), device=DEVICE)
    kept[..., 0] = 0.0
    mass, _, thr = cluster_masses(ranked, size, members, kept, 0.3, 0.2, 100)
    in_p1, wanted, exact = _sets(mass, thr, size > 0)
    assert in_p1.all() and wanted.all() and exact.all()
    _, _, thr = cluster_masses(ranked, size, members, kept, 0.3, 0.2, 29)  # one class of 30 members: cut whole
    assert not _sets(mass, thr, size > 0)[2].any()
    ranked[0, :, :4] = 1.0  # a heavier class of four
    mass, _, thr = cluster_masses(ranked, size, members, kept, 0.3, 0.2, 29)
    in_p1, wanted, exact = _sets(mass, thr, size > 0)
    assert exact.sum() == 4 and exact[0, :4].all() and wanted[0, :4].all()


@pytest.mark.parametrize("R,G,C,W", SIZES[:4] + ([(16, 4, 5000, 69)] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("tail,waves", [(True, 4), (False, 64)])
def test_mark_clusters_equals_reference(R, G, C, W, tail, waves):
    """Flags as the reference, centroid terms to rounding, with runs of several blocks a program (4 waves on the
    interpreter's 4 "SMs") or one."""
    ranked, size, members, kept = _inputs(R, G, C, W, C + tail)
    g = torch.Generator().manual_seed(C)
    D = 32
    logits = ranked - torch.rand(R, G, C, generator=g).to(DEVICE)
    value_mean = torch.randn(R, C, D, generator=g).to(DEVICE)
    mass, _, thr = cluster_masses(ranked, size, members, kept, 0.9, 0.5, 10 * C)
    flags, parts = mark_clusters(mass, thr, size, logits, value_mean, tail, block=32, waves=waves)
    ref_flags, ref_parts = mark_clusters_ref(mass, thr, size, logits, value_mean, tail)
    assert torch.equal(flags, ref_flags)
    for a, b in zip(parts, ref_parts):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    approx, exact, in_p1 = ((flags & bit) != 0 for bit in (APPROX, EXACT, IN_P1))
    assert not (approx & exact).any() and not (exact & ~in_p1).any()


@pytest.mark.parametrize("R,C,N,chunk", [(1, 1, 1, 16), (4, 13, 90, 16), (6, 200, 1000, 64)]
                         + ([(128, 16384, 131072, 1024)] if DEVICE == "cuda" else []))
def test_exact_members_equal_reference_and_csr_order(R, C, N, chunk):
    """The exact clusters' members appended after each row's slots, in CSR order, rolled-back ones left out, then
    the decoded slots of exact clusters: as the reference, and (nothing rolled back or decoded) as `csr_members`
    lists them."""
    g = torch.Generator().manual_seed(N)
    sizes = torch.randint(0, 4, (R, C), generator=g)
    sizes = (sizes * N // sizes.sum(-1, keepdim=True).clamp_min(1)).clamp_max(N // C + 3)  # at most N a row
    offsets = torch.zeros(R, C + 1, dtype=torch.long)
    offsets[:, 1:] = sizes.cumsum(-1)
    ends = offsets[:, 1:].contiguous()
    cluster = torch.searchsorted(ends, torch.arange(N).expand(R, N).contiguous(), right=True).int()
    perm = torch.stack([torch.randperm(N + 50, generator=g)[:N] for _ in range(R)])
    flags = (torch.randint(0, 2, (R, C), generator=g) * EXACT).to(torch.int8)
    B = R // 2 if R % 2 == 0 else R
    count = torch.randint(0, 5, (R,), generator=g).int()
    idx = torch.randint(0, 99, (R, 4 + N), generator=g).int()
    S, W2 = N + 80, 30  # decoded clustered slots [csr_end, clustered_end), found through `assign`
    assign = torch.randint(-1, C, (R, S), generator=g)
    idx = torch.cat([idx, torch.zeros(R, W2, dtype=torch.int32)], -1)
    dev = [t.to(DEVICE) for t in (perm, cluster, flags, idx, count, assign)]
    for csr_end in (torch.full((B,), N + 50), torch.randint(0, N + 50, (B,), generator=g)):
        clustered_end = (csr_end + torch.randint(0, W2 + 5, (B,), generator=g)).clamp_max(S).to(DEVICE)
        got_idx, got_count = dev[3].clone(), dev[4].clone()
        got_count = append_exact_members(dev[0], dev[1], dev[2], csr_end.to(DEVICE), got_idx, got_count, dev[5],
                                         clustered_end, W2, chunk=chunk)
        ref_idx, ref_count = dev[3].clone(), dev[4].clone()
        ref_count = append_exact_members_ref(dev[0], dev[1], dev[2], csr_end.to(DEVICE), ref_idx, ref_count,
                                             dev[5], clustered_end, W2)
        assert torch.equal(got_count, ref_count)
        for r in range(R):
            assert torch.equal(got_idx[r, :got_count[r]], ref_idx[r, :ref_count[r]])
    slots, valid = csr_members(perm[:, None], offsets[:, None], (flags[:, None] & EXACT) != 0)
    want = [slots[r, 0][valid[r, 0]] for r in range(R)]
    idx, count = dev[3].clone(), torch.zeros(R, dtype=torch.int32, device=DEVICE)
    count = append_exact_members(dev[0], dev[1], dev[2], torch.full((B,), N + 50, device=DEVICE), idx, count,
                                 chunk=chunk)
    for r in range(R):
        assert torch.equal(idx[r, :count[r]].long().cpu(), want[r])


@pytest.mark.parametrize("tail,p,cap,index", [("drop", (0.95, 0.7), 1.0, "float32"),
                                              ("approx", (0.99, 0.9), 12, "float32"),
                                              ("approx", (0.99, 0.9), 1.0, "bfloat16")])
def test_fixed_steps_through_the_kernels_equal_the_sorted_path(monkeypatch, tail, p, cap, index):
    """The fixed-width steps through the kernels (the CUDA path; on CPU under the interpreter) give the outputs of
    the sorted torch path, over two rows of different lengths with tokens joining clusters as the window moves
    (with bf16 centroids, variances and mean values, up to their rounding: the torch path's centroid terms read the
    fp32 value sums). The kernels take the clusters of one mass class (2^-7 wide) together where the sorted path
    takes them one by one: here the sorted path takes whole classes too (`thresholds_ref`), else a class that
    holds two clusters where a top-p target falls (as on the H200, whose k-means gives other clusters) would
    differ by design."""
    import sparsespec.attention.doublep as doublep

    from .test_doublep import make_cache

    def by_classes(mass, valid, base, p1, p2, selected, members, cap):  # select_clusters, whole classes at a time
        assert not selected
        R = base.numel()
        m, ok = mass.reshape(R, -1).float().contiguous(), valid.reshape(R, -1)
        thr = thresholds_ref(m, base.reshape(R).float(), ok, members.reshape(R, -1), p1, p2,
                             1 << 40 if cap is None else cap)
        u = (m.view(torch.int32) >> 16).long()
        return [(ok & (u >= thr[:, j:j + 1])).view(mass.shape) for j in range(3)]

    monkeypatch.setattr(doublep, "select_clusters", by_classes)

    opts = DoublePOptions(sinks=2, window=4, cluster_size=4, p1=p[0], p2=p[1], tail=tail, dense_layers=0,
                          exact_cap=cap, index_dtype=index)
    lengths = [50, 37]
    caches = [make_cache(2, 2, 70, 16, seed=7, offset=1.0, device=DEVICE) for _ in range(2)]
    sorted_path, kernels = DoubleP(opts), DoubleP(opts)
    gen = torch.Generator().manual_seed(1)
    with monkeypatch.context() as patch:  # the same clusters for both (the torch k-means)
        patch.setattr(doublep, "triton_ready", lambda device: False)
        for policy, cache in zip((sorted_path, kernels), caches):
            policy.build(0, cache, lengths)
            policy.plan_fixed(cache, lengths)
    for _ in range(4):
        positions = torch.tensor(lengths, device=DEVICE)
        q = torch.randn(2, 4, 1, 16, generator=gen).to(DEVICE)
        outs = []
        for use_kernels, policy, cache in ((False, sorted_path, caches[0]), (True, kernels, caches[1])):
            with monkeypatch.context() as patch:
                patch.setattr(doublep, "triton_ready", lambda device, on=use_kernels: on)
                policy.begin_step(positions)
                outs.append(policy.decode(0, q, cache, positions))
        tol = 1e-5 if index == "float32" else 1e-2
        torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
        lengths = [n + 1 for n in lengths]
    torch.testing.assert_close(kernels.fixed.attended, sorted_path.fixed.attended)
