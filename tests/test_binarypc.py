"""BinaryPC pieces against their definitions: fitting, residual encoding, packing, popcount scoring, safeguard."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsespec.attention.binarypc import (
    BinaryPC, BinaryPCOptions, encode, fit_basis, pack_bits, packed_scores, popcount, quantize_probe,
    safeguard_mask, unpack_bits,
)
from sparsespec.attention.policy import SelectionOptions, select_top
from sparsespec.attention.topk import OracleTopK

from .conftest import cache_with_keys


def anisotropic_keys(G, N, D, seed):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -1.5, D)
    return torch.randn(G, N, D, generator=g) * scales + torch.randn(G, 1, D, generator=g)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=50))
def test_popcount_matches_python(values):
    x = torch.tensor(values, dtype=torch.int64)
    assert popcount(x).tolist() == [bin(v & (2**64 - 1)).count("1") for v in values]


@pytest.mark.parametrize("b", [1, 17, 64, 100, 128])
def test_pack_unpack_roundtrip(b):
    bits = torch.rand(3, 5, b, generator=torch.Generator().manual_seed(b)) > 0.5
    codes = pack_bits(bits)
    assert codes.shape == (3, 5, -(-b // 64)) and codes.dtype == torch.int64
    assert torch.equal(unpack_bits(codes, b), bits)


@pytest.mark.parametrize("b,magnitude_bits", [(64, 7), (5, 7), (100, 7), (64, 3), (128, 12)])
def test_packed_popcount_score_equals_float_reference(b, magnitude_bits):
    g = torch.Generator().manual_seed(b + magnitude_bits)
    B, Hkv, G, S = 2, 3, 4, 37
    signs = torch.rand(B, Hkv, S, b, generator=g) > 0.5
    probe = quantize_probe(torch.randn(B, Hkv, G, b, generator=g), magnitude_bits)
    assert probe.abs().max() <= 2**magnitude_bits - 1
    got = packed_scores(pack_bits(signs), probe, magnitude_bits)
    h = signs.double() * 2 - 1  # ±1
    reference = torch.einsum("bhgi,bhsi->bhgs", probe.double(), h)  # Σ p̃_i h_i
    assert torch.equal(got, reference.long())


def test_fitting_lowers_reconstruction_error_with_every_bit():
    keys = anisotropic_keys(2, 300, 32, seed=1)
    basis = fit_basis(keys, bits=24, iters=4, generator=torch.Generator().manual_seed(0))
    errors = [encode(keys, basis[:, :i])[1].pow(2).mean().item() for i in range(1, 25)]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.2 * keys.pow(2).sum(-1).mean().item()


def test_encoding_matches_residual_definition():
    keys = anisotropic_keys(2, 20, 16, seed=3)
    basis = fit_basis(keys, bits=12, iters=4, generator=torch.Generator().manual_seed(0))
    signs, err = encode(keys, basis)
    for g in range(2):
        for n in range(20):
            r = keys[g, n].double()
            for i in range(12):
                h = 1.0 if float(r @ basis[g, i].double()) >= 0 else -1.0
                assert signs[g, n, i].item() == (h > 0)
                r = r - h * basis[g, i].double()
            assert abs(r.norm().item() - err[g, n].item()) < 1e-4


def test_safeguard_selects_exactly_the_largest_errors_encoded_at_build():
    g = torch.Generator().manual_seed(4)
    keys = anisotropic_keys(6, 50, 16, seed=4).view(2, 3, 50, 16)
    cache = cache_with_keys(keys)
    policy = BinaryPC(BinaryPCOptions(budget=0.5, dense_layers=0, safeguard=0.3, bits=8))
    policy.build(0, cache, [45, 40])
    state = cache.policy_state[0]
    counts = [5, 2]
    mask = safeguard_mask(state.safe, counts, 50, 50)
    for b, (n, length) in enumerate(zip(counts, [45, 40])):
        for h in range(3):
            error = state.error[b, h, :length]
            chosen = torch.nonzero(mask[b, h]).flatten()
            assert len(chosen) == n and bool((chosen < length).all())
            # the chosen errors are the n largest (whichever way equal errors are ordered)
            assert torch.equal(error[chosen].sort(descending=True).values, error.topk(n).values)
    del g


@pytest.mark.parametrize("seed", range(5))
def test_planted_needle_is_always_selected(seed):
    g = torch.Generator().manual_seed(seed)
    B, Hkv, S, D = 2, 2, 400, 32
    keys = anisotropic_keys(B * Hkv, S, D, seed).view(B, Hkv, S, D)
    q = torch.randn(B, Hkv * 2, 1, D, generator=g)
    needles = torch.randint(10, S - 10, (B, Hkv), generator=g)
    for b in range(B):
        for h in range(Hkv):
            keys[b, h, needles[b, h]] = 4 * q[b, 2 * h, 0] / q[b, 2 * h, 0].norm() * keys.norm(dim=-1).mean()
    cache = cache_with_keys(keys)
    positions = torch.full((B,), S - 1)
    for policy in (BinaryPC(BinaryPCOptions(budget=0.02, dense_layers=0)),
                   OracleTopK(SelectionOptions(budget=0.02, dense_layers=0))):
        policy.build(0, cache, [S] * B)
        idx, valid = policy.select(0, q, cache, positions)
        for b in range(B):
            for h in range(Hkv):
                chosen = set(idx[b, h][valid[b, h]].tolist())
                assert needles[b, h].item() in chosen, (policy.name, b, h)


def test_budget_rules_and_forced_slots():
    scores = torch.zeros(1, 1, 100)
    scores[0, 0, 50] = 5.0
    opts = BinaryPCOptions(budget=0.1, sinks=2, window=3, min_tokens=0)
    idx, valid = select_top(scores, torch.tensor([99]), opts)
    chosen = set(idx[0, 0][valid[0, 0]].tolist())
    assert len(chosen) == 10 and {0, 1, 97, 98, 99, 50} <= chosen
    assert BinaryPCOptions(budget=2048).tokens(10_000) == 2048
    assert BinaryPCOptions().tokens(1000) == 1000 and BinaryPCOptions().tokens(4000) == 1024  # the default floor
    assert BinaryPCOptions().tokens(60_000) == 1200  # past 51.2k tokens the 2% budget is above the floor
    assert (BinaryPCOptions().sinks, BinaryPCOptions().window) == (4, 64)  # inside the budget
    assert BinaryPCOptions(min_tokens=0).tokens(1000) == 20
    assert BinaryPCOptions(budget=0.02, min_tokens=128).tokens(1000) == 128
