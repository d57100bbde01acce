"""Quest, Double Sparsity and MagicPIG against their definitions, and against dense attention at a full budget."""

import pytest
import torch
from safetensors import safe_open

from sparsespec.attention.dense import causal_mask, dense_attention
from sparsespec.attention.doublesparse import (
    DoubleSparse, DoubleSparseOptions, calibrate_label_channels, load_labels, save_labels,
)
from sparsespec.attention.magicpig import MagicPIG, MagicPIGOptions, collision_counts, hyperplanes, simhash
from sparsespec.attention.policy import parse_options
from sparsespec.attention.quest import Quest, QuestOptions, page_bounds, page_extrema
from sparsespec.errors import SparseSpecError

from .conftest import cache_with_keys


def _chosen(idx, valid, b, h):
    return set(idx[b, h][valid[b, h]].tolist())


def _forced(pos, sinks, window):
    return {s for s in range(pos + 1) if s < sinks or s > pos - max(window, 1)}


# ---------------------------------------------------------------------------------------------- Quest

@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page,n", [(16, 53), (5, 23), (1, 7)])
def test_quest_page_bound_is_an_upper_bound_per_query_head(seed, page, n):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 4, 24, generator=g)  # [B, Hkv, G, D]
    keys = torch.randn(2, 3, n, 24, generator=g) * torch.rand(24, generator=g) * 3  # last page partial
    kmin, kmax = page_extrema(keys, page)
    bounds = page_bounds(q, kmin, kmax)  # [B, Hkv, G, P]
    # The definition, written out: Σ_d max(q_d·min_d, q_d·max_d).
    qd = q[..., :, None, :]  # [B, Hkv, G, 1, D]
    by_definition = torch.maximum(qd * kmin[..., None, :, :], qd * kmax[..., None, :, :])
    torch.testing.assert_close(bounds, by_definition.sum(-1), rtol=1e-5, atol=1e-5)
    exact = q @ keys.transpose(-1, -2)  # [B, Hkv, G, n]
    for p in range(bounds.shape[-1]):
        true_max = exact[..., p * page:(p + 1) * page].amax(-1)
        assert (bounds[..., p] >= true_max - 1e-5).all()
        assert torch.equal(kmin[..., p, :], keys[..., p * page:(p + 1) * page, :].amin(-2))


def test_quest_page_of_one_repeated_key_is_exact():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 24, generator=g)
    key = torch.randn(24, generator=g)
    kmin, kmax = page_extrema(key.expand(16, 24), 16)  # [1, D]
    torch.testing.assert_close(page_bounds(q, kmin, kmax)[:, 0], q @ key, rtol=1e-5, atol=1e-5)


def _quest_state(keys, lengths, page):
    cache = cache_with_keys(keys)
    policy = Quest(QuestOptions(dense_layers=0, page=page))
    policy.build(0, cache, lengths)
    return cache.policy_state[0]


def _assert_same_pages(a, b, page):
    assert a.committed == b.committed
    for row, n in enumerate(a.committed):
        pages = -(-n // page)
        assert torch.equal(a.kmin[row, :, :pages], b.kmin[row, :, :pages])
        assert torch.equal(a.kmax[row, :, :pages], b.kmax[row, :, :pages])


@pytest.mark.parametrize("page", [16, 5])
def test_quest_append_and_rollback_equal_a_fresh_build(page):
    g = torch.Generator().manual_seed(page)
    keys = torch.randn(2, 2, 61, 24, generator=g)
    cache = cache_with_keys(keys)
    policy = Quest(QuestOptions(dense_layers=0, page=page))
    policy.build(0, cache, [20, 33])
    for step in range(1, 21):  # one decoded token per step, then a jump (a speculative commit of several)
        policy.append(0, cache, [20 + step, 33 + step])
    policy.append(0, cache, [47, 60])
    _assert_same_pages(cache.policy_state[0], _quest_state(keys, [47, 60], page), page)

    policy.append(0, cache, [31, 34])  # rollback: the extrema may only cover slots [0, length)
    _assert_same_pages(cache.policy_state[0], _quest_state(keys, [31, 34], page), page)
    for b, n in enumerate([31, 34]):  # new tokens overwrite the dead slots
        cache.k[0][b, :, n:] = torch.randn(2, 61 - n, 24, generator=g) * 5
    policy.append(0, cache, [44, 52])
    _assert_same_pages(cache.policy_state[0], _quest_state(cache.k[0].clone(), [44, 52], page), page)


def test_quest_scores_are_group_summed_page_bounds_and_skip_uncommitted_slots():
    g = torch.Generator().manual_seed(1)
    page, S = 8, 53
    keys = torch.randn(2, 2, S, 24, generator=g)
    cache = cache_with_keys(keys)
    policy = Quest(QuestOptions(dense_layers=0, page=page))
    lengths = [52, 30]
    policy.build(0, cache, lengths)
    q = torch.randn(2, 4, 1, 24, generator=g)
    positions = torch.tensor(lengths)
    scores = policy.scores(0, q, cache, positions)  # [B, Hkv, 53]
    for b, n in enumerate(lengths):
        kmin, kmax = page_extrema(keys[b, :, :n], page)  # [Hkv, P, D]
        summed = page_bounds(q[b, :, 0].view(2, 2, 24), kmin, kmax).sum(1)  # [Hkv, P]
        for s in range(S):
            if s < n:
                torch.testing.assert_close(scores[b, :, s], summed[:, s // page])
            else:
                assert (scores[b, :, s] == float("-inf")).all()
    # The selection is whole pages, as Quest's: a budget of 2 pages + 1 token rounds up to 3 pages, the query's
    # own page (up to the query) and the two best of the others; never fewer keys than the budget.
    policy = Quest(QuestOptions(dense_layers=0, page=page, budget=2 * page + 1, min_tokens=0, sinks=0, window=0))
    idx, valid = policy.select(0, q, cache, positions)
    for b, n in enumerate(lengths):
        for h in range(2):
            own = n // page
            top = scores[b, h, :own * page:page].topk(2).indices.tolist()
            expected = {s for p in top + [own] for s in range(p * page, min((p + 1) * page, n + 1))}
            assert _chosen(idx, valid, b, h) == expected and len(expected) >= 2 * page + 1


@pytest.mark.parametrize("page", [1, 5, 8])
def test_quest_attends_at_least_its_budget_and_less_than_a_page_more(page):
    g = torch.Generator().manual_seed(page)
    S = 70
    keys = torch.randn(1, 2, S, 24, generator=g)
    cache = cache_with_keys(keys)
    policy = Quest(QuestOptions(dense_layers=0, page=page, budget=20, min_tokens=0, sinks=0, window=0))
    policy.build(0, cache, [S - 1])
    q = torch.randn(1, 4, 1, 24, generator=g)
    for pos in range(24, S):
        _, valid = policy.select(0, q, cache, torch.tensor([pos]))
        assert (20 <= valid.sum(-1)).all() and (valid.sum(-1) < 20 + page).all(), pos


# ---------------------------------------------------------------------------------------------- Double Sparsity

def test_calibration_picks_the_planted_channels():
    g = torch.Generator().manual_seed(0)
    Hq, Hkv, N, D = 4, 2, 200, 24
    q, k = torch.randn(Hq, N, D, generator=g), torch.randn(Hkv, N, D, generator=g)
    planted = {0: [2, 11, 19], 1: [0, 7, 23]}
    for h, chans in planted.items():
        q[2 * h:2 * h + 2, :, chans] *= 6
        k[h, :, chans] *= 6
        q[2 * h:2 * h + 2, :, 5] *= 30  # a huge query channel whose keys are ~0 contributes nothing
        k[h, :, 5] *= 1e-3
    labels = calibrate_label_channels({3: q}, {3: k}, channels=3)
    assert set(labels) == {"layer3"} and labels["layer3"].dtype == torch.int64 and labels["layer3"].shape == (2, 3)
    for h, chans in planted.items():
        assert set(labels["layer3"][h].tolist()) == set(chans)
    # All-pairs mean |q_d k_d| over the group, written out (this equals E|q_d|·E|k_d|); sorted most important first.
    contribution = (q.view(Hkv, 2, N, 1, D).abs() * k.view(Hkv, 1, 1, N, D).abs()).mean(dim=(1, 2, 3))
    assert torch.equal(calibrate_label_channels({0: q}, {0: k}, 8)["layer0"], contribution.topk(8).indices)
    with pytest.raises(SparseSpecError):
        calibrate_label_channels({0: q}, {0: k}, channels=25)


def test_label_file_roundtrip(tmp_path):
    labels = {"layer0": torch.tensor([[3, 1], [0, 2]]), "layer5": torch.tensor([[7, 6], [5, 4]])}
    path = tmp_path / "labels.safetensors"
    save_labels(path, labels, {"model": "tiny", "channels": 2})
    loaded = load_labels(path)
    assert set(loaded) == set(labels) and all(torch.equal(loaded[n], labels[n]) for n in labels)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"model": "tiny", "channels": "2"}
    with pytest.raises(SparseSpecError):
        load_labels(tmp_path / "missing.safetensors")


def _label_file(tmp_path, labels):
    path = tmp_path / "labels.safetensors"
    save_labels(path, {"layer0": labels})
    return str(path)


def test_doublesparse_scores_are_label_channel_products_maxed_over_the_group(tmp_path):
    g = torch.Generator().manual_seed(2)
    B, Hkv, G, S, D = 2, 2, 2, 53, 24
    labels = torch.stack([torch.randperm(D, generator=g)[:6] for _ in range(Hkv)])  # [Hkv, 6]
    policy = DoubleSparse(DoubleSparseOptions(dense_layers=0, channels=4, labels=_label_file(tmp_path, labels)))
    keys = torch.randn(B, Hkv, S, D, generator=g)
    cache = cache_with_keys(keys)
    policy.build(0, cache, [S - 1, 40])
    q = torch.randn(B, Hkv * G, 1, D, generator=g)
    scores = policy.scores(0, q, cache, torch.tensor([S - 1, 40]))
    for b in range(B):
        for h in range(Hkv):
            c = labels[h, :4]  # the first `channels` columns: the most important
            per_head = torch.stack([keys[b, h][:, c] @ q[b, h * G + j, 0, c] for j in range(G)])  # [G, S]
            torch.testing.assert_close(scores[b, h], per_head.amax(0))


def test_doublesparse_needs_a_fitting_label_file(tmp_path):
    with pytest.raises(SparseSpecError, match="sparsespec calibrate doublesparse"):
        DoubleSparse(DoubleSparseOptions())
    with pytest.raises(SparseSpecError, match="not found"):
        DoubleSparseOptions(labels=str(tmp_path / "missing.safetensors"))
    cache = cache_with_keys(torch.randn(1, 2, 10, 8))
    for labels, channels in ((torch.tensor([[0, 1]] * 3), 2), (torch.tensor([[0, 1]] * 2), 3),
                             (torch.tensor([[0, 8]] * 2), 2)):  # wrong Hkv, too few channels, index past D
        policy = DoubleSparse(DoubleSparseOptions(dense_layers=0, channels=channels,
                                                  labels=_label_file(tmp_path, labels)))
        with pytest.raises(SparseSpecError, match="does not fit"):
            policy.build(0, cache, [10])


# ---------------------------------------------------------------------------------------------- MagicPIG

def test_simhash_matches_its_definition_and_planes_are_seeded_per_layer():
    planes = hyperplanes(5, 7, 12, seed=3, layer=1)
    assert torch.equal(planes, hyperplanes(5, 7, 12, seed=3, layer=1))
    assert not torch.equal(planes, hyperplanes(5, 7, 12, seed=3, layer=2))
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(0))
    codes = simhash(x, planes)  # [4, 5]
    for n in range(4):
        for t in range(5):
            assert codes[n, t].item() == sum(int(float(planes[t, i] @ x[n]) >= 0) << i for i in range(7))


def _dyadic(x):
    """Round to multiples of 1/8: sums and means of a few such numbers are exact in fp32."""
    return torch.round(x * 8) / 8


def test_magicpig_key_along_the_query_collides_everywhere_and_is_selected():
    g = torch.Generator().manual_seed(0)
    B, Hkv, S, D = 2, 2, 80, 24
    keys = _dyadic(torch.randn(B, Hkv, S, D, generator=g) * 2)
    q = _dyadic(torch.randn(B, Hkv * 2, 1, D, generator=g))
    cache = cache_with_keys(keys)
    policy = MagicPIG(MagicPIGOptions(dense_layers=0, budget=6, sinks=0, window=0))
    policy.build(0, cache, [64, 64])  # 64 prefill keys: their mean is exact
    state = cache.policy_state[0]
    needle = 70
    for b in range(B):
        for h in range(Hkv):  # a decoded key whose centred form is 4 q of the KV head's first query head
            cache.k[0][b, h, needle] = state.mean[b, h] + 4 * q[b, 2 * h, 0]
    policy.append(0, cache, [79, 79])
    q_codes = simhash(q.view(B, Hkv, 2, D), state.planes).to(state.codes.dtype)
    counts = collision_counts(state.codes[:, :, :80], q_codes)  # [B, Hkv, G, S]
    assert (counts[:, :, 0, needle] == policy.options.tables).all()
    idx, valid = policy.select(0, q, cache, torch.tensor([79, 79]))
    for b in range(B):
        for h in range(Hkv):
            assert needle in _chosen(idx, valid, b, h)


def test_magicpig_append_and_rollback_hash_like_build():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 2, 61, 24, generator=g)
    cache = cache_with_keys(keys)
    policy = MagicPIG(MagicPIGOptions(dense_layers=0, hash_bits=6, tables=9))
    policy.build(0, cache, [20, 33])
    state = cache.policy_state[0]

    def expected(lengths):
        return [simhash(cache.k[0][b, :, :n] - state.mean[b, :, None], state.planes) for b, n in enumerate(lengths)]

    for b, n in enumerate([20, 33]):
        torch.testing.assert_close(state.mean[b], keys[b, :, :n].mean(1))
    for step in range(1, 12):
        policy.append(0, cache, [20 + step, 33 + step])
    policy.append(0, cache, [50, 60])
    assert state.hashed == [50, 60]
    for b, want in enumerate(expected([50, 60])):
        assert torch.equal(state.codes[b, :, :want.shape[1]].long(), want)
    policy.append(0, cache, [25, 40])  # rollback, then new tokens in the dead slots
    assert state.hashed == [25, 40]
    for b, n in enumerate([25, 40]):
        cache.k[0][b, :, n:] = torch.randn(2, 61 - n, 24, generator=g)
    policy.append(0, cache, [45, 58])
    for b, want in enumerate(expected([45, 58])):
        assert torch.equal(state.codes[b, :, :want.shape[1]].long(), want)


@pytest.mark.parametrize("min_collisions", [1, 3, 5])
def test_magicpig_selects_exactly_the_forced_slots_and_the_colliding_indexed_keys(min_collisions):
    g = torch.Generator().manual_seed(min_collisions)
    B, Hkv, G, S, D = 2, 2, 2, 53, 24
    keys = torch.randn(B, Hkv, S, D, generator=g)
    cache = cache_with_keys(keys)
    opts = MagicPIGOptions(dense_layers=0, budget=1.0, sinks=2, window=3, hash_bits=3, tables=10,
                           min_collisions=min_collisions)
    policy = MagicPIG(opts)
    positions, hashed = [52, 37], [48, 30]
    policy.build(0, cache, hashed)  # slots [hashed, position) are in the cache but not in the index
    state = cache.policy_state[0]
    q = torch.randn(B, Hkv * G, 1, D, generator=g)
    idx, valid = policy.select(0, q, cache, torch.tensor(positions))
    for b, pos in enumerate(positions):
        for h in range(Hkv):
            q_codes = [simhash(q[b, h * G + j, 0], state.planes) for j in range(G)]  # [L] each
            colliding = {s for s in range(hashed[b])
                         if max(int((state.codes[b, h, s].long() == qc).sum()) for qc in q_codes) >= min_collisions}
            assert _chosen(idx, valid, b, h) == colliding | _forced(pos, opts.sinks, opts.window)


# ---------------------------------------------------------------------------------------------- all three

def test_options_are_validated_and_parsed():
    assert parse_options(QuestOptions, ["page=8", "budget=0.05"]) == QuestOptions(page=8, budget=0.05)
    assert QuestOptions().dense_layers == 2 and (MagicPIGOptions().sinks, MagicPIGOptions().window) == (4, 64)
    assert parse_options(MagicPIGOptions, {"tables": "32", "hash_bits": "10"}).tables == 32
    assert QuestOptions(page=4096).page == 4096
    for bad in (lambda: QuestOptions(page=0), lambda: QuestOptions(page=4097), lambda: DoubleSparseOptions(channels=0),
                lambda: MagicPIGOptions(hash_bits=32), lambda: MagicPIGOptions(tables=4, min_collisions=5)):
        with pytest.raises(SparseSpecError):
            bad()


def _full_budget_policy(name, tmp_path):
    if name == "quest16":
        return Quest(QuestOptions(budget=1.0, dense_layers=0))
    if name == "quest5":
        return Quest(QuestOptions(budget=1.0, dense_layers=0, page=5))
    if name == "doublesparse":
        g = torch.Generator().manual_seed(9)
        labels = calibrate_label_channels({0: torch.randn(4, 30, 24, generator=g)},
                                          {0: torch.randn(2, 30, 24, generator=g)}, channels=8)
        path = tmp_path / "labels.safetensors"
        save_labels(path, labels)
        return DoubleSparse(DoubleSparseOptions(budget=1.0, dense_layers=0, channels=8, labels=str(path)))
    return MagicPIG(MagicPIGOptions(budget=1.0, dense_layers=0, sinks=0, window=0, min_collisions=0))


@pytest.mark.parametrize("name", ["quest16", "quest5", "doublesparse", "magicpig"])
def test_full_budget_equals_dense_attention(name, tmp_path):
    g = torch.Generator().manual_seed(len(name))
    B, Hq, Hkv, S, D = 2, 4, 2, 53, 24
    cache = cache_with_keys(torch.randn(B, Hkv, S, D, generator=g))
    policy = _full_budget_policy(name, tmp_path)
    positions = torch.tensor([52, 37])
    policy.build(0, cache, [30, 21])  # prefill, then decoded tokens committed in two steps
    policy.append(0, cache, [45, 30])
    policy.append(0, cache, positions.tolist())
    q = torch.randn(B, Hq, 1, D, generator=g)
    got = policy.decode(0, q, cache, positions)
    keys, values = cache.keys(0, S)
    want = dense_attention(q, keys, values, causal_mask(positions[:, None], S))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
