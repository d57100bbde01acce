"""Top-p baselines: oracle top-p reaches p on every head by construction; Twilight stays inside its candidates."""

from dataclasses import asdict

import pytest
import torch

from sparsespec.attention import check_policies, make_policy, shared_options
from sparsespec.attention.dense import causal_mask, dense_attention
from sparsespec.attention.topp import fake_quantize, mask_to_indices, top_p_mask

from .conftest import cache_with_keys


def test_top_p_mask_is_the_smallest_prefix_reaching_p():
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(4, 30, generator=g).mul(2).softmax(-1)
    for p in (0.3, 0.8, 0.95, 1.0):
        mask = top_p_mask(probs, p)
        for row, m in zip(probs, mask):
            kept = row[m]
            assert kept.sum() >= p - 1e-6
            assert kept.sum() - kept.min() < p  # dropping the smallest kept entry falls short: smallest set
            assert row[~m].max() <= kept.min() if (~m).any() else True


def test_mask_to_indices_round_trip():
    mask = torch.rand(2, 3, 17, generator=torch.Generator().manual_seed(1)) > 0.6
    idx, valid = mask_to_indices(mask)
    back = torch.zeros_like(mask).scatter(-1, idx, valid)
    assert torch.equal(back, mask)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
def test_oracle_top_p_reaches_p_on_every_query_head(p):
    g = torch.Generator().manual_seed(2)
    B, Hkv, S, D = 2, 2, 61, 16
    cache = cache_with_keys(torch.randn(B, Hkv, S, D, generator=g) * 2)
    q = torch.randn(B, 2 * Hkv, 1, D, generator=g)
    positions = torch.tensor([60, 41])
    policy = make_policy("topp", {"p": str(p), "dense_layers": "0"})
    idx, valid = policy.select(0, q, cache, positions)
    for b in range(B):
        n = int(positions[b]) + 1
        keys = cache.k[0][b, :, :n].repeat_interleave(2, dim=0)
        probs = ((q[b, :, 0, None, :] * keys).sum(-1) / D**0.5).softmax(-1)  # [Hq, n]
        for h in range(2 * Hkv):
            chosen = idx[b, h // 2][valid[b, h // 2]]
            assert (chosen <= positions[b]).all()
            assert probs[h, chosen].sum() >= p - 1e-5


def test_full_p_reproduces_dense():
    g = torch.Generator().manual_seed(3)
    cache = cache_with_keys(torch.randn(2, 2, 40, 8, generator=g))
    q = torch.randn(2, 4, 1, 8, generator=g)
    positions = torch.tensor([39, 22])
    for name in ("topp", "twilight"):
        opts = {"p": "1.0", "dense_layers": "0"} | ({"candidates": "1.0"} if name == "twilight" else {})
        policy = make_policy(name, opts)
        policy.build(0, cache, [40, 23])
        out = policy.decode(0, q, cache, positions)
        ref = dense_attention(q, cache.k[0], cache.v[0], causal_mask(positions[:, None], 40))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_twilight_selects_within_candidates_and_forced_slots():
    g = torch.Generator().manual_seed(4)
    cache = cache_with_keys(torch.randn(1, 2, 200, 16, generator=g))
    q = torch.randn(1, 4, 1, 16, generator=g)
    positions = torch.tensor([199])
    policy = make_policy("twilight", {"p": "0.9", "candidates": "0.2", "dense_layers": "0", "sinks": "2",
                                      "window": "4"})
    policy.build(0, cache, [200])
    cand, cand_valid = policy.base.select(0, q, cache, positions)
    idx, valid = policy.select(0, q, cache, positions)
    for h in range(2):
        allowed = set(cand[0, h][cand_valid[0, h]].tolist()) | {0, 1, 196, 197, 198, 199}
        chosen = set(idx[0, h][valid[0, h]].tolist())
        assert chosen <= allowed and {0, 1, 199} <= chosen
        assert len(chosen) < len(allowed)  # top-p inside the candidates drops some


def test_fake_quantize_error_shrinks_with_bits():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    errors = [(fake_quantize(x, b) - x).abs().max().item() for b in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[1] <= (x.amax(-1) - x.amin(-1)).max().item() / 15 / 2 + 1e-6


@pytest.mark.parametrize("name", ["topp", "twilight", "doublep"])
def test_top_p_policies_take_no_budget(name, tmp_path):
    """They attend by attention mass: a budget was accepted and silently ignored; now it is refused (fidelity runs
    them once, without one), and a results folder recorded when they listed one still matches."""
    from sparsespec.errors import SparseSpecError
    from sparsespec.eval.fidelity import FidelityConfig
    from sparsespec.results import check_folder, record_settings

    with pytest.raises(SparseSpecError, match="unknown attention option 'budget'"):
        make_policy(name, {"budget": "0.5"})
    # a run's shared budget ("--attention-opt budget=0.5") is for the policies that take one; taken by none: refused
    assert shared_options(name, ["budget=0.5", "dense_layers=1"]) == (name, {"dense_layers": "1"})
    assert shared_options("topk", ["budget=0.5"]) == ("topk", {"budget": "0.5"})
    check_policies([name, "topk"], ["budget=0.5"])
    with pytest.raises(SparseSpecError, match="'budget=0.5' is taken by none of this run's policies"):
        check_policies([name, "dense"], ["budget=0.5"])
    fidelity = FidelityConfig(policies=("topk", name))  # it runs them once, at no budget
    assert not fidelity.takes_budget(name) and fidelity.takes_budget("topk")
    assert fidelity.policy(name, None).options == make_policy(name).options
    options = asdict(make_policy(name).options)
    record_settings(tmp_path, {f"policy {name}": {"budget": 0.02, **options}}, ("results.jsonl",))
    (tmp_path / "results.jsonl").write_text('{"policy": "%s"}\n' % name)
    check_folder(tmp_path, {f"policy {name}": options}, ("results.jsonl",))  # the option it lost took no part
    changed = {**options, "dense_layers": options["dense_layers"] + 1}
    with pytest.raises(SparseSpecError, match=f"other settings \\(policy {name}\\)"):
        check_folder(tmp_path, {f"policy {name}": changed}, ("results.jsonl",))


@pytest.mark.parametrize("base", ["topp", "dense", "doublep"])
def test_twilight_refuses_a_base_that_selects_no_keys(base):
    from sparsespec.errors import SparseSpecError

    with pytest.raises(SparseSpecError, match=f"needs a selection policy as its base, not '{base}'"):
        make_policy("twilight", {"base": base})
