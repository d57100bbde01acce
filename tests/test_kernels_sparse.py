"""The BinaryPC and selection kernels against their torch references: on CPU through Triton's interpreter at small,
odd sizes (make test), on the GPU at full sizes when CUDA is there. Inputs are fresh random draws per case; where a
float sum's order could flip a sign, the inputs are small dyadic numbers whose sums are exact in any order."""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")

from sparsespec.kernels.binarypc import (TableLayout, byte_tables, encode_slots, encode_slots_ref,  # noqa: E402
                                         key_range, packed_probe, probe_bytes, probe_packed, probe_tables,
                                         probe_tables_ref, sample_copy, sampled_keys_ref, score_keys, score_keys_dp4a,
                                         score_keys_ref)
from sparsespec.kernels.scores import quest_keys, quest_keys_ref, topk_keys, topk_keys_ref  # noqa: E402
from sparsespec.kernels.select import (SAMPLE_STRIDE, candidate_thresholds, candidate_thresholds_ref,  # noqa: E402
                                       expand_pages, expand_pages_ref, ordered_keys,
                                       same_selection, sampled_slots, select_scratch, select_topk,
                                       select_topk_ref)

from .conftest import DEVICE, cuda_only  # noqa: E402


def dyadic(g: torch.Generator, *shape, scale=8) -> torch.Tensor:
    return (torch.randint(-scale, scale + 1, shape, generator=g) / scale).to(DEVICE)


def assert_same_probe(probe: torch.Tensor, other: torch.Tensor, q: torch.Tensor, basis: torch.Tensor, m: int):
    """Two quantised probes [R, G, b] of q against basis: equal, except one level where the unquantised value lies on
    a rounding boundary (a float dot product summed in another order may land on either side of it)."""
    B, Hkv, _, D = basis.shape
    exact = q.double().view(B, Hkv, -1, D) @ basis.double().transpose(-1, -2)
    level = (exact / exact.abs().amax(dim=(-2, -1), keepdim=True) * ((1 << m) - 1)).flatten(0, 1)
    differ = probe != other
    assert int((probe - other).abs().max()) <= 1
    assert bool(((level[differ] - level[differ].floor() - 0.5).abs() < 1e-4).all())


@pytest.mark.parametrize("G,D,bits,m,per", [(1, 64, 64, 7, None), (4, 128, 64, 7, 8), (7, 64, 100, 3, 2),
                                            (3, 16, 7, 5, None), (6, 128, 256, 7, 3), (5, 32, 64, 12, 1)])
def test_probe_tables_equal_reference(G, D, bits, m, per):
    g = torch.Generator().manual_seed(G * 1000 + bits)
    B, Hkv = 2, 3
    q = torch.randn(B, Hkv * G, D, generator=g).to(DEVICE)
    basis = torch.randn(B, Hkv, bits, D, generator=g).to(DEVICE)
    probe, tables = probe_tables(q, basis, m, per)  # per: code bytes a program (a last program may have fewer)
    assert_same_probe(probe, probe_tables_ref(q, basis, m)[0], q, basis, m)
    assert torch.equal(tables, byte_tables(probe, m))  # the tables: exactly those of the kernel's probe
    assert tables.shape[-2:] == (-(-bits // 8), 256)


@pytest.mark.parametrize("rows,nb", [(8, 8), (64, 8), (128, 8), (256, 8), (4096, 8), (3, 1), (300, 32), (100, 13)])
def test_probe_bytes_rule(rows, nb):
    """A power of two of at most half the row's bytes (one where that is below one), leaving ~512 programs or
    more: short programs while the device is not full."""
    per = probe_bytes(rows, nb)
    assert per >= 1 and per & (per - 1) == 0 and (per == 1 or per <= nb // 2)
    assert per == 1 or rows * -(-nb // per) >= 512


def test_byte_tables_sum_to_the_probe_dot_the_signs():
    g = torch.Generator().manual_seed(3)
    R, G, bits, m = 2, 5, 24, 7
    probe = torch.randint(-127, 128, (R, G, bits), generator=g)
    tables = byte_tables(probe, m)
    lay = TableLayout.of(G, bits, m)
    code = torch.randint(0, 1 << bits, (), generator=g)
    h = ((code >> torch.arange(bits)) & 1) * 2 - 1  # [b]: +1 where the bit is set
    entries = sum(tables[:, :, j, int(code >> (8 * j)) & 255] for j in range(lay.nb))  # [R, T]
    for head in range(G):
        tb, lane = divmod(head, lay.lanes)
        got = (entries[:, tb] >> (lane * lay.lane_bits)) & ((1 << lay.lane_bits) - 1)
        assert torch.equal(got - lay.nb * lay.bias, (probe[:, head] * h).sum(-1))


def assert_samples(samples: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, Hkv: int) -> None:
    """A scorer's copy of the sampled slots' keys: the keys of the live sampled slots; the others left alone."""
    slots = sampled_slots(keys.shape[1], SAMPLE_STRIDE, keys.device)
    live = slots <= positions.long().repeat_interleave(Hkv)[:, None]  # [R, NS] (a slot past S: never live)
    assert torch.equal(samples[live], sampled_keys_ref(keys)[live])
    assert bool((samples[~live] == -5).all())


def random_codes(g: torch.Generator, B: int, Hkv: int, S: int, bits: int) -> torch.Tensor:
    """codes [B, Hkv, S, W] int64 of `bits` random bits (the top bit of a full word too)."""
    W = -(-bits // 64)
    codes = torch.randint(-(1 << 62), 1 << 62, (B, Hkv, S, W), generator=g)
    codes[..., 0] |= torch.randint(0, 2, (B, Hkv, S), generator=g) << 63
    if bits % 64:
        codes[..., -1] &= (1 << (bits % 64)) - 1
    return codes.to(DEVICE)


def scoring_case(seed: int, G: int, bits: int, m: int, S: int):
    """A scorer test's inputs: 3 rows of 2 KV heads (G query heads each, head_dim 16) of S slots, rows at three
    lengths -> (B, Hkv, codes, q, basis, positions, samples: a sample copy buffer poisoned with -5)."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, D = 3, 2, 16
    codes = random_codes(g, B, Hkv, S, bits)
    q = torch.randn(B, Hkv * G, D, generator=g).to(DEVICE)
    basis = torch.randn(B, Hkv, bits, D, generator=g).to(DEVICE)
    positions = torch.tensor([S - 1, S // 2, 0], dtype=torch.int32, device=DEVICE)
    samples = sample_copy(B * Hkv, S, key_range(bits, m)[1], DEVICE).fill_(-5)
    return B, Hkv, codes, q, basis, positions, samples


@pytest.mark.parametrize("G,bits,m,S", [(1, 64, 7, 37), (4, 64, 7, 300), (7, 128, 7, 129), (2, 40, 4, 70),
                                        (3, 64, 12, 50), (6, 256, 7, 90)])
def test_score_keys_equal_popcount_reference(G, bits, m, S):
    B, Hkv, codes, q, basis, positions, samples = scoring_case(S * 7 + G, G, bits, m, S)
    probe, tables = probe_tables_ref(q, basis, m)
    keys = score_keys(codes, tables, positions, m, bits, G, samples=samples)
    ref = score_keys_ref(codes, probe, positions, m, bits)
    live = torch.arange(S, device=DEVICE) <= positions.long().repeat_interleave(Hkv)[:, None]
    assert torch.equal(keys[live], ref[live])
    assert_samples(samples, ref, positions, Hkv)
    offset, key_bits = key_range(bits, m)
    assert (key_bits <= 15) == (ref.dtype == torch.int16) and int(ref[live].min()) >= 1
    assert int(ref[live].max()) < (1 << key_bits) - 1  # below the forced key
    # the same numbers as the float reference: the group max of p̃ · h, shifted by the offset
    h = ((codes[..., None] >> torch.arange(64, device=DEVICE)) & 1).flatten(-2)[..., :bits] * 2 - 1  # [B,Hkv,S,b]
    direct = (probe.view(B, Hkv, G, 1, bits).double() * h[:, :, None].double()).sum(-1).amax(2).flatten(0, 1)
    assert torch.equal(ref[live].long(), direct[live].long() + offset)


@pytest.mark.parametrize("G,D,bits,m", [(1, 64, 64, 7), (4, 128, 64, 7), (7, 16, 70, 3), (3, 16, 7, 5),
                                        (2, 16, 256, 7), (3, 16, 131, 1)])
def test_probe_packed_equals_reference(G, D, bits, m):
    g = torch.Generator().manual_seed(G * 100 + bits)
    B, Hkv = 2, 3
    q = torch.randn(B, Hkv * G, D, generator=g).to(DEVICE)
    basis = torch.randn(B, Hkv, bits, D, generator=g).to(DEVICE)
    probe, packed, sums = probe_packed(q, basis, m)
    assert_same_probe(probe, probe_tables(q, basis, m)[0], q, basis, m)  # the table scorer's probe
    ref_packed, ref_sums = packed_probe(probe)  # packed: exactly the kernel's own probe, packed
    assert torch.equal(packed, ref_packed) and torch.equal(sums, ref_sums)
    assert packed.shape == (B * Hkv, G, 2 * -(-bits // 64), 8)


def test_packed_probe_dotted_with_the_byte_masks_gives_the_probe_dot_the_bits():
    """What the dp4a scorer computes, in torch: for each 32-bit half and k < 8, the bytes of (half >> k) & 0x01010101
    times the packed probe's signed bytes, summed, is Σ_i p̃_i b_i; twice it less Σ p̃ is Σ p̃_i h_i."""
    g = torch.Generator().manual_seed(5)
    R, G, bits = 3, 4, 100
    probe = torch.randint(-127, 128, (R, G, bits), generator=g)
    packed, sums = packed_probe(probe)
    code = random_codes(g, 1, 1, 1, bits).cpu().view(-1)  # [W]
    halves = torch.stack([code & 0xFFFFFFFF, (code >> 32) & 0xFFFFFFFF], 1).flatten()  # [H]
    y = torch.arange(4)

    def signed(v):  # int32 [...] -> its four bytes as signed integers [..., 4]
        b = (v.long()[..., None] >> (8 * y)) & 255
        return b - ((b & 128) << 1)

    total = torch.zeros(R, G, dtype=torch.int64)
    for h in range(len(halves)):
        for k in range(8):
            mask = (halves[h] >> k) & 0x01010101
            total += (((mask >> (8 * y)) & 255) * signed(packed[:, :, h, k])).sum(-1)
    b = (code[:, None] >> torch.arange(64)) & 1  # [W, 64]
    b = b.flatten()[:bits]
    assert torch.equal(total, (probe * b).sum(-1))
    h_signs = b * 2 - 1
    assert torch.equal(2 * total - sums.long(), (probe * h_signs).sum(-1))


@pytest.mark.parametrize("G,bits,m,S", [(1, 64, 7, 37), (4, 64, 7, 150), (7, 128, 7, 40), (2, 40, 4, 70),
                                        (3, 64, 1, 50), (2, 256, 7, 45), (3, 131, 6, 33)])
def test_score_keys_dp4a_equal_popcount_reference(G, bits, m, S):
    B, Hkv, codes, q, basis, positions, samples = scoring_case(S * 11 + G, G, bits, m, S)
    probe, packed, sums = probe_packed(q, basis, m)
    keys = score_keys_dp4a(codes, packed, sums, positions, m, bits, block=64, samples=samples)
    ref = score_keys_ref(codes, probe, positions, m, bits)
    live = torch.arange(S, device=DEVICE) <= positions.long().repeat_interleave(Hkv)[:, None]
    assert keys.dtype == ref.dtype and torch.equal(keys[live], ref[live])
    assert_samples(samples, ref, positions, Hkv)
    # and the table scorer's keys for the same probe
    assert torch.equal(keys[live], score_keys(codes, byte_tables(probe, m), positions, m, bits, G)[live])


@pytest.mark.parametrize("scorer", ["tables", "dp4a"])
def test_scorers_write_the_forced_list_as_the_select_would(scorer):
    """`extra=`: each row's listed slots (up to its count, up to the query) at the maximal key, in the sample copy
    too, the rest of the keys as without a list — what `select_topk(extra=)` writes before it selects."""
    G, bits, m, S, E = 4, 64, 7, 150, 20
    B, Hkv, codes, q, basis, positions, samples = scoring_case(S + E, G, bits, m, S)
    g = torch.Generator().manual_seed(E)
    listed = torch.randint(0, S, (B * Hkv, E), generator=g, dtype=torch.int32).to(DEVICE)  # (repeats too)
    counts = torch.tensor([E + 5, 7, 0], dtype=torch.int32, device=DEVICE)  # (more than the list: all of it)
    probe, packed, sums = probe_packed(q, basis, m)

    def score(**kw):
        if scorer == "dp4a":
            return score_keys_dp4a(codes, packed, sums, positions, m, bits, block=64, **kw)
        return score_keys(codes, byte_tables(probe, m), positions, m, bits, G, block=64, **kw)

    plain_samples = samples.clone()
    want = score(samples=plain_samples)
    by_hand, by_hand_samples = want.clone(), plain_samples.clone()
    for r in range(B * Hkv):
        b = r // Hkv
        for slot in listed[r, :int(counts[b])].tolist():
            if slot <= int(positions[b]):
                by_hand[r, slot] = -1  # all bits set: the maximal key
                if slot in sampled_slots(S, SAMPLE_STRIDE).tolist():
                    by_hand_samples[r, slot // SAMPLE_STRIDE] = -1
    # the select's own forced-list pass writes into the keys and the copy it is given, in place
    select_topk(want, positions, positions + 1, positions + 1, 8, key_range(bits, m)[1], extra=listed, extra_n=counts,
                samples=plain_samples)
    keys = score(samples=samples, extra=(listed, counts))
    live = torch.arange(S, device=DEVICE) <= positions.long().repeat_interleave(Hkv)[:, None]
    assert torch.equal(keys[live], want[live]) and torch.equal(want[live], by_hand[live])
    assert int((keys[live] == -1).sum()) > 5
    assert torch.equal(samples, plain_samples) and torch.equal(samples, by_hand_samples)


@cuda_only
@pytest.mark.parametrize("B,S,block,warps", [(4, 131072, 1024, 4), (16, 32771, 512, 4), (3, 100003, 2048, 8)])
def test_score_keys_dp4a_at_full_size_equal_the_table_scorer(B, S, block, warps):
    """Llama-3.1-8B's heads (8 KV heads, 4 query heads each, 64-bit codes, 7-bit probes) at full size, rows of
    different lengths, the tilings `bench/scorers.py` times: dp4a on the device gives the table scorer's keys."""
    g = torch.Generator().manual_seed(S + B)
    Hkv, G, D, bits, m = 8, 4, 128, 64, 7
    codes = random_codes(g, B, Hkv, S, bits)
    q = torch.randn(B, Hkv * G, D, generator=g).to(DEVICE, torch.bfloat16)
    basis = torch.randn(B, Hkv, bits, D, generator=g).to(DEVICE)
    positions = torch.randint(S // 2, S, (B,), generator=g).to(DEVICE)
    probe, packed, sums = probe_packed(q, basis, m)
    keys = score_keys_dp4a(codes, packed, sums, positions, m, bits, block=block, num_warps=warps)
    want = score_keys(codes, byte_tables(probe, m), positions, m, bits, G)
    live = torch.arange(S, device=DEVICE) <= positions.long().repeat_interleave(Hkv)[:, None]
    assert torch.equal(keys[live], want[live])


@pytest.mark.parametrize("D,bits,S,max_slots", [(16, 64, 37, 37), (64, 64, 20, 5), (32, 100, 45, 45), (16, 7, 9, 9)])
def test_encode_slots_equal_reference(D, bits, S, max_slots):
    g = torch.Generator().manual_seed(D + bits + S)
    B, Hkv = 2, 3
    W = -(-bits // 64)
    k = torch.randint(-4, 5, (B, Hkv, S, D), generator=g).float().to(DEVICE)
    basis = dyadic(g, B, Hkv, bits, D)
    start = torch.tensor([0, S // 3], dtype=torch.int32, device=DEVICE)
    end = torch.tensor([S, S - 2], dtype=torch.int32, device=DEVICE)
    poison = torch.randint(-(1 << 62), 1 << 62, (B, Hkv, S, W), generator=g).to(DEVICE)
    codes, ref_codes = poison.clone(), poison.clone()
    error, ref_error = torch.full((B, Hkv, S), -1.0, device=DEVICE), torch.full((B, Hkv, S), -1.0, device=DEVICE)
    encode_slots(k, basis, codes, error, start, end, max_slots)
    encode_slots_ref(k, basis, ref_codes, ref_error, start, end, max_slots)
    assert torch.equal(codes, ref_codes)  # slots outside each row's range untouched
    assert torch.allclose(error, ref_error, rtol=1e-5, atol=1e-5)


def test_encode_slots_in_bf16_keep_the_codes():
    g = torch.Generator().manual_seed(5)
    k = torch.randint(-4, 5, (1, 2, 33, 64), generator=g).to(DEVICE, torch.bfloat16)
    basis = dyadic(g, 1, 2, 64, 64)
    start, end = torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.full((1,), 33, dtype=torch.int32,
                                                                               device=DEVICE)
    out = [torch.zeros(1, 2, 33, 1, dtype=torch.int64, device=DEVICE), torch.zeros(1, 2, 33, device=DEVICE)]
    ref = [t.clone() for t in out]
    encode_slots(k, basis, *out, start, end, 33)
    encode_slots_ref(k.float(), basis, *ref, start, end, 33)
    assert torch.equal(out[0], ref[0])


def _check_selection(keys, positions, tokens, forced_from, k, key_bits, blocks=(2048,), candidates=False, **kw):
    ref_idx, ref_count = select_topk_ref(keys, positions, tokens, forced_from, k, key_bits, **kw)
    # the radix path; with `candidates` and keys of up to 16 bits also the candidate path (a threshold from one
    # slot in 4, no margin: rows that keep too few candidates fall back, the others are served by theirs)
    paths = [dict(sampled=False)] + ([dict(sampled=True, stride=4, margin=0)] if candidates and key_bits <= 16
                                     else [])
    for block in blocks:  # 2048: one block a row; 64: many blocks shared by several programs a row (the candidate
        for path in paths:  # path's compaction too: runs of 64-slot blocks)
            idx = torch.full_like(ref_idx, -7)
            count = torch.full_like(ref_count, -7)
            attended = torch.full((len(positions),), 0.5, device=DEVICE)
            select_topk(keys.clone(), positions, tokens, forced_from, k, key_bits, out=(idx, count), block=block,
                        scan_block=block, attended=attended, **path, **kw)
            assert torch.equal(count, ref_count), path
            assert torch.allclose(attended, 0.5 + ref_count.view(len(positions), -1).float().mean(-1))
            for r in range(keys.shape[0]):
                n = int(count[r])
                assert idx[r, :n].tolist() == ref_idx[r, :n].tolist(), (block, path, r)
    return idx, count


@pytest.mark.parametrize("S,Hkv,key_bits,spread", [(37, 1, 16, 3), (300, 2, 14, 16000), (129, 2, 32, 0),
                                                     (250, 2, 13, 40), (90, 2, 8, 200), (200, 1, 15, 30000),
                                                     (150, 2, 16, 65000)])
def test_select_topk_equals_reference(S, Hkv, key_bits, spread):
    g = torch.Generator().manual_seed(S + Hkv + key_bits)
    B = 3
    positions = torch.tensor([S - 1, S // 2, 3], dtype=torch.int32, device=DEVICE)
    if key_bits <= 16:  # few distinct values: many ties at the threshold (int16 keys of up to 16 bits)
        keys = torch.randint(1, max(2, spread), (B * Hkv, S), generator=g).to(torch.int16).to(DEVICE)
        keys[0, 5:9] = 0  # never attended
    else:  # fp32 scores with ties and infinities, through the order-preserving map
        scores = torch.randn(B * Hkv, S, generator=g).round(decimals=spread).to(DEVICE)
        scores[0, 3] = float("-inf")
        scores[-1, 1] = float("inf")
        keys = ordered_keys(scores)
    widths = ([(5, 9, 2), 12], [(S, S, S), S], [(1, 1, 1), 8], [(60, 2, 4), 64])
    forced = ((0, 0), (2, 3), (4, 40))
    # every width with every forced set on the GPU; on the interpreter (minutes for the whole product) each width
    # once and each forced set at least once, the many-block and candidate paths (window 3) with two widths
    combos = (itertools.product(widths, forced) if DEVICE == "cuda" else
              zip(widths, (forced[1], forced[2], forced[0], forced[1])))
    for (tokens, k), (sinks, window) in combos:
        tokens = torch.tensor(tokens, dtype=torch.int32, device=DEVICE)
        forced_from = positions + 1
        _check_selection(keys, positions, tokens, forced_from, k, key_bits, sinks=sinks, window=window,
                         blocks=(2048, 64) if window == 3 else (2048,), candidates=window == 3)
    # slots from forced_from on (BinaryPC: not yet encoded) and a policy's forced list
    forced_from = torch.tensor([S - 3, S // 2 - 1, 0], dtype=torch.int32, device=DEVICE)
    extra = torch.randint(0, S, (B * Hkv, 6), generator=g).int().to(DEVICE)
    extra_n = torch.tensor([6, 2, 0], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([7, 3, 2], dtype=torch.int32, device=DEVICE)
    idx, count = _check_selection(keys, positions, tokens, forced_from, 20, key_bits, sinks=1, window=2,
                                  extra=extra, extra_n=extra_n, blocks=(2048, 32), candidates=True)
    chosen = set(idx[0, :count[0]].tolist())
    assert {S - 3, S - 2, S - 1, 0} <= chosen and set(extra[0].tolist()) <= chosen


@pytest.mark.parametrize("block", [32, 2048])
def test_select_reusing_one_scratch_equals_reference(block):
    """One scratch shared by selects of different keys, widths and forced lists (as a plan's layers and steps
    share it): each the reference's selection, the scratch left zeroed by each."""
    g = torch.Generator().manual_seed(block)
    B, Hkv, S = 3, 2, 300
    R = B * Hkv
    scratch = select_scratch(R, DEVICE)
    extra = torch.stack([torch.randperm(S, generator=g)[:9] for _ in range(R)]).int().to(DEVICE)
    for key_bits, positions, forced_from, tokens, extra_n, sinks, window in (
            (14, [S - 1, S // 2, 3], [S - 3, S // 2 - 1, 0], [7, 3, 2], [9, 2, 0], 1, 2),
            (32, [S - 2, 5, S - 1], [S - 1, 6, S], [40, 1, 12], [3, 9, 5], 0, 0),
            (8, [S - 1, S - 1, 0], [S, S, 1], [S, 20, 1], [0, 0, 1], 4, 40),
            (14, [S - 1, 100, 7], [S, 101, 8], [30, 30, 30], [9, 9, 9], 0, 1)):
        positions, forced_from, tokens, extra_n = (torch.tensor(t, dtype=torch.int32, device=DEVICE) for t in
                                                   (positions, forced_from, tokens, extra_n))
        if key_bits == 32:
            keys = ordered_keys(torch.randn(R, S, generator=g).round(decimals=1).to(DEVICE))
        else:
            keys = torch.randint(1, 1 << key_bits - 1, (R, S), generator=g).to(torch.int16).to(DEVICE)
        opts = dict(sinks=sinks, window=window, extra=extra, extra_n=extra_n)
        ref_idx, ref_count = select_topk_ref(keys, positions, tokens, forced_from, 48, key_bits, **opts)
        for sampled in (False, True) if key_bits <= 16 else (False,):
            idx, count = select_topk(keys.clone(), positions, tokens, forced_from, 48, key_bits, scratch=scratch,
                                     block=block, scan_block=block, sampled=sampled, stride=4, **opts)
            assert torch.equal(count, ref_count), (key_bits, sampled)
            for r in range(R):
                assert idx[r, :count[r]].tolist() == ref_idx[r, :count[r]].tolist(), (key_bits, sampled, r)
            assert not bool(scratch.any())  # zero again for the next select


@pytest.mark.parametrize("block", [64, 2048])
def test_candidate_path_rows_that_fall_back_equal_reference(block):
    """Rows whose sampled threshold misses (the sampled slots hold the row's only high keys: too few candidates
    above it) or whose candidates overflow (a flat row: every key ties at the threshold) take the radix path in the
    same call, beside rows the candidates serve; every row is the reference's selection."""
    g = torch.Generator().manual_seed(block + 1)
    B, Hkv, S, k, stride = 2, 3, 1500, 240, 16
    R = B * Hkv
    keys = torch.randint(1, 3000, (R, S), generator=g).to(torch.int16)
    sampled = sampled_slots(S, stride).clamp_max(S - 1)
    keys[0, sampled] = 15000  # the sample sees only these: its threshold keeps ~94 of the 200 wanted
    keys[1] = 7  # flat: every key a candidate, more than fit
    keys[4, ::3] = 9000
    keys = keys.to(DEVICE)
    positions = torch.tensor([S - 1, S - 200], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([200, 25], dtype=torch.int32, device=DEVICE)
    ref_idx, ref_count = select_topk_ref(keys, positions, tokens, positions + 1, k, 14, sinks=2, window=3)
    served = torch.full((R,), -1, dtype=torch.int32, device=DEVICE)
    idx, count = select_topk(keys.clone(), positions, tokens, positions + 1, k, 14, sampled=True, stride=stride,
                             margin=0, block=block, scan_block=block, sinks=2, window=3, served=served)
    # rows 0 and 1 fell back and row 4 (437 candidates, 25 wanted) was served, as built; the rest, random keys
    # thresholded with no margin, either way
    assert served[:2].tolist() == [0, 0] and int(served[4]) == 1 and set(served.tolist()) <= {0, 1}
    assert torch.equal(count, ref_count)
    for r in range(R):
        assert idx[r, :count[r]].tolist() == ref_idx[r, :count[r]].tolist(), r
    # the sample's 94 slots and the candidates streamed 32 at a time (rows of more than `resident_keys` of them):
    # the same thresholds, so the same rows served and the same selection
    streamed = torch.full((R,), -1, dtype=torch.int32, device=DEVICE)
    again = select_topk(keys.clone(), positions, tokens, positions + 1, k, 14, sampled=True, stride=stride,
                        margin=0, block=block, scan_block=block, sinks=2, window=3, served=streamed, resident_keys=32)
    assert torch.equal(streamed, served) and same_selection(again, (idx, count))
    # with room for 4 widths (2,048 candidates, not 1,024) the flat row's 1,500 ties fit: served, the same selection
    idx, count = select_topk(keys.clone(), positions, tokens, positions + 1, k, 14, sampled=True, stride=stride,
                             margin=0, room=4, block=block, scan_block=block, sinks=2, window=3, served=served)
    assert served[:2].tolist() == [0, 1] and torch.equal(count, ref_count)
    for r in range(R):
        assert idx[r, :count[r]].tolist() == ref_idx[r, :count[r]].tolist(), r
    select_topk(keys.clone(), positions, tokens, positions + 1, k, 14, sampled=False, block=block, served=served)
    assert not served.any()  # the radix path serves no row by candidates


@pytest.mark.parametrize("key_bits,spread,stride", [(14, 3000, 16), (8, 200, 4), (13, 8000, 8), (16, 60000, 16)])
def test_candidate_thresholds_equal_reference(key_bits, spread, stride):
    """The sample's threshold (the key at the target rank of the sampled keys, 1 where fewer are live) as the
    reference ranks it: keys with many ties, rows of different lengths, forced sinks / window / tail, a budget past
    the live keys (threshold 1); the sample held in registers or streamed 8 slots at a time, read from the row or
    from the scorer's copy."""
    g = torch.Generator().manual_seed(key_bits + stride)
    B, Hkv, S, k = 3, 2, 700, 120
    keys = torch.randint(1, spread, (B * Hkv, S), generator=g)
    keys[1, ::5] = (1 << key_bits) - 2  # a row whose top keys crowd one value
    keys = keys.to(torch.int16).to(DEVICE)  # (16-bit keys: their 16 bits, as the scorers store them)
    positions = torch.tensor([S - 1, 400, 9], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([100, 30, 50], dtype=torch.int32, device=DEVICE)  # the last: more than its 10 slots
    forced_from = torch.tensor([S - 3, 401, 10], dtype=torch.int32, device=DEVICE)
    opts = dict(sinks=2, window=3, stride=stride, margin=4)
    want = candidate_thresholds_ref(keys, positions, tokens, forced_from, k, key_bits, **opts)
    assert int(want[-1]) == 1 and bool((want[:2] > 1).all())
    slots = sampled_slots(S, stride, DEVICE)
    copy = torch.where(slots < S, keys[:, slots.clamp_max(S - 1)], 0).contiguous()  # as a scorer writes it
    for resident in (8192, 8):
        for samples in (None, copy):
            got = candidate_thresholds(keys, positions, tokens, forced_from, k, key_bits, samples=samples,
                                       resident_keys=resident, **opts)
            assert torch.equal(got, want), (resident, samples is None)


def test_candidate_select_where_the_threshold_lies_far_above_the_sample_estimate():
    """The candidates' own select finds its threshold by a rank search from the sample's estimate up, wherever it
    lies: rows of keys packed close (1 to 3000: the threshold 18 and 78 above the estimate) and spread wide
    (distinct, 10 and 40 apart: 720 and 320 above it), each served and equal to the reference."""
    g = torch.Generator().manual_seed(3)
    B, Hkv, S, k = 2, 2, 1500, 256
    R = B * Hkv
    keys = torch.randint(1, 3000, (R, S), generator=g)
    keys[1] = torch.randperm(S, generator=g) * 10 + 1
    keys[2] = torch.randperm(S, generator=g) * 40 % 16000 + 1
    keys = keys.to(torch.int16).to(DEVICE)
    positions = torch.tensor([S - 1, S - 100], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([200, 150], dtype=torch.int32, device=DEVICE)
    ref_idx, ref_count = select_topk_ref(keys, positions, tokens, positions + 1, k, 14, sinks=1, window=2)
    served = torch.zeros(R, dtype=torch.int32, device=DEVICE)
    idx, count = select_topk(keys.clone(), positions, tokens, positions + 1, k, 14, sampled=True, stride=4,
                             margin=0, sinks=1, window=2, served=served)
    assert served.tolist() == [1] * R and torch.equal(count, ref_count)
    for r in range(R):
        assert idx[r, :count[r]].tolist() == ref_idx[r, :count[r]].tolist(), r
    for bad in (dict(pick_block=1 << 15), dict(block=3000), dict(scan_block=4)):  # (counts packed 15 bits a half)
        with pytest.raises(ValueError, match="powers of two"):
            select_topk(keys.clone(), positions, tokens, positions + 1, k, 14, sampled=True, **bad)


@pytest.mark.parametrize("stride", [16, 32])
def test_the_samples_copy_gives_the_same_selection_and_rows_served(stride):
    """`select_topk(samples=)`: the sample passes read the sampled slots' keys from their copy — the same selection
    and the same rows served as sampling the row itself, with a forced list of sampled and other slots (written
    into the copy too) and copy entries past a row's position holding garbage."""
    g = torch.Generator().manual_seed(stride)
    B, Hkv, S, k = 2, 3, 1500, 240
    R = B * Hkv
    keys = torch.randint(1, 3000, (R, S), generator=g).to(torch.int16)
    slots = sampled_slots(S, stride)
    keys[0, slots.clamp_max(S - 1)] = 15000  # the sample sees only these: row 0 falls back
    keys[4, ::3] = 9000
    keys = keys.to(DEVICE)
    positions = torch.tensor([S - 1, S - 200], dtype=torch.int32, device=DEVICE)
    tokens = torch.tensor([200, 25], dtype=torch.int32, device=DEVICE)
    # each row's forced list: three sampled slots (below and past the second row's position) and two others
    n_s = len(slots)
    listed = torch.stack([torch.cat([slots[[5 + r, n_s // 2, n_s - 2]], slots[[7, n_s // 3]] + 1]) for r in range(R)])
    extra, extra_n = listed.int().to(DEVICE), torch.tensor([5, 4], dtype=torch.int32, device=DEVICE)
    at = slots.to(DEVICE)
    copy = torch.where(at < S, keys[:, at.clamp_max(S - 1)], 0)  # [R, NS]
    past = at > positions.repeat_interleave(Hkv)[:, None]
    copy = torch.where(past, torch.randint(1, 30000, copy.shape, generator=g).to(DEVICE, torch.int16), copy)
    runs = {}
    for name, samples in (("row", None), ("copy", copy)):
        served = torch.full((R,), -1, dtype=torch.int32, device=DEVICE)
        runs[name] = (*select_topk(keys.clone(), positions, tokens, positions + 1, k, 14, extra=extra, extra_n=extra_n,
                                   sampled=True, stride=stride, sinks=2, window=3, served=served,
                                   samples=samples), served)
    (idx, count, served), (idx2, count2, served2) = runs["row"], runs["copy"]
    assert same_selection((idx, count), (idx2, count2)) and torch.equal(served, served2)
    assert int(served[0]) == 0 and 1 in served.tolist()  # a row that fell back, and rows served
    ref_idx, ref_count = select_topk_ref(keys, positions, tokens, positions + 1, k, 14, sinks=2, window=3,
                                         extra=extra, extra_n=extra_n)
    idx, count, _ = runs["copy"]
    assert torch.equal(count, ref_count)
    for r in range(R):
        assert idx[r, :count[r]].tolist() == ref_idx[r, :count[r]].tolist(), r
    # the listed sampled slots up to each row's position now hold the forced key in the copy; the runs of the listed
    # slots that are not sampled keep their sampled key
    for r in range(R):
        b = r // Hkv
        forced = set(listed[r, :int(extra_n[b])].tolist())
        for slot in forced:
            at = slot // stride
            if int(slots[at]) not in forced:
                assert int(copy[r, at]) == int(keys[r, slots[at]]), (r, slot)
            elif int(slots[at]) <= int(positions[b]):
                assert int(copy[r, at]) == -1, (r, slot)
    # and the sample passes read the copy, not the row: a copy whose every key is maximal puts row 4's threshold at
    # the top, too few candidates — it falls back, to the same selection
    copy[4] = 16383
    served = torch.zeros(R, dtype=torch.int32, device=DEVICE)
    poisoned = select_topk(keys.clone(), positions, tokens, positions + 1, k, 14, extra=extra, extra_n=extra_n,
                           sampled=True, stride=stride, sinks=2, window=3, served=served, samples=copy)
    assert int(runs["row"][2][4]) == 1 and int(served[4]) == 0 and same_selection(poisoned, (idx, count))


@cuda_only
@pytest.mark.parametrize("B,S,budget", [(1, 131072, 2622), (4, 131072, 2622), (16, 32768, 656), (3, 100003, 2000)])
def test_selection_at_full_size_equals_reference(B, S, budget):
    """BinaryPC's own keys (table-scored 64-bit codes of correlated keys, 7-bit probes) at full size, rows of
    different lengths: the candidate path and the radix path select what the reference does."""
    g = torch.Generator().manual_seed(S + B)
    Hkv, G, D, bits, m = 8, 4, 128, 64, 7
    basis = torch.randn(B, Hkv, bits, D, generator=g).to(DEVICE)
    k = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE) + torch.randn(B, Hkv, 1, D, generator=g).to(DEVICE)
    codes = torch.zeros(B, Hkv, S, 1, dtype=torch.int64, device=DEVICE)
    lengths = torch.tensor([S - 1 - 977 * i for i in range(B)], dtype=torch.int32, device=DEVICE)
    encode_slots(k, basis, codes, torch.zeros(B, Hkv, S, device=DEVICE), torch.zeros_like(lengths), lengths + 1, S)
    _, tables = probe_tables(torch.randn(B, Hkv * G, D, generator=g).to(DEVICE), basis, m)
    keys = score_keys(codes, tables, lengths, m, bits, G)
    key_bits = key_range(bits, m)[1]
    tokens = (lengths + 1) * budget // S
    args = (keys, lengths, tokens, lengths + 1, budget + 68, key_bits)
    opts = dict(sinks=4, window=64)
    ref_idx, ref_count = select_topk_ref(*args, **opts)
    live = torch.arange(ref_idx.shape[1], device=DEVICE) < ref_count[:, None]
    for sampled in (True, False):
        idx, count = select_topk(keys.clone(), *args[1:], sampled=sampled, **opts)
        assert torch.equal(count, ref_count), sampled
        assert torch.equal(torch.where(live, idx, -1), torch.where(live, ref_idx, -1)), sampled


def test_candidate_path_is_taken_by_shape():
    from sparsespec.kernels.select import candidate_width, takes_candidates

    assert takes_candidates(128, 131072, 2622, 14) and takes_candidates(32, 131072, 2622, 14)
    assert not takes_candidates(8, 131072, 2622, 14)  # too few rows for its extra launches (batch 1 of 8 KV heads)
    assert not takes_candidates(8, 1 << 20, 20972, 14)  # ... at any length
    assert takes_candidates(16, 131072, 2622, 14) and not takes_candidates(16, 65536, 1379, 14)  # from 2 M keys
    assert takes_candidates(64, 32768, 724, 14) and not takes_candidates(32, 32768, 724, 14)
    assert not takes_candidates(128, 131072, 2622, 32)  # 32-bit keys: the radix path
    assert not takes_candidates(128, 16384, 4000, 14)  # candidates would fill a quarter of the row
    assert candidate_width(2622, 131072) == 8192 and candidate_width(5, 100) == 100
    assert candidate_width(2622, 131072, room=4) == 16384  # more room against ties at the threshold
    assert takes_candidates(128, 32768, 2000, 14) and not takes_candidates(128, 32768, 2000, 14, room=4)  # ... which
    # must still fit a quarter of the row


def test_ordered_keys_keep_the_order_of_scores():
    scores = torch.tensor([[float("-inf"), -3.5, -0.0, 0.0, 1e-30, 2.0, 3e38, float("inf")]])
    keys = ordered_keys(scores).long() & 0xFFFFFFFF
    assert keys[0, 0] == 0 and keys[0, -1] == 0xFFFFFFFF
    assert keys[0, 2] == keys[0, 3] and bool((keys[0, 3:].diff() > 0).all()) and keys[0, 1] < keys[0, 2]


@pytest.mark.parametrize("G,D,S,dtype", [(1, 16, 37, torch.float32), (4, 64, 130, torch.bfloat16),
                                         (7, 16, 70, torch.float16)])
def test_topk_keys_equal_reference(G, D, S, dtype):
    g = torch.Generator().manual_seed(G + D + S)
    B, Hkv = 3, 2
    q = dyadic(g, B, Hkv * G, D).to(dtype)
    k = dyadic(g, B, Hkv, S, D).to(dtype)
    positions = torch.tensor([S - 1, S // 3, 0], dtype=torch.int32, device=DEVICE)
    ref = topk_keys_ref(q, k, positions)
    live = torch.arange(S, device=DEVICE) <= positions.long().repeat_interleave(Hkv)[:, None]
    for dot in (False, True):  # dyadic values: every order of the sums is exact
        keys = topk_keys(q, k, positions, block=32, dot=dot)
        assert torch.equal(keys[live], ref[live]), dot


@pytest.mark.parametrize("G,D,S,page", [(1, 16, 37, 7), (4, 64, 130, 16), (7, 16, 70, 5), (2, 32, 64, 16),
                                        (3, 128, 45, 1)])
def test_quest_keys_equal_reference(G, D, S, page):
    g = torch.Generator().manual_seed(G + D + S + page)
    B, Hkv = 4, 2
    NP = -(-S // page)
    q = dyadic(g, B, Hkv * G, D)
    k = dyadic(g, B, Hkv, S, D).bfloat16()
    a, b = dyadic(g, B, Hkv, NP, D), dyadic(g, B, Hkv, NP, D)
    kmin, kmax = torch.minimum(a, b).bfloat16(), torch.maximum(a, b).bfloat16()
    # the last committed token opening a page, inside one, at slot 0, and the first query
    positions = torch.tensor([S - 1, S // 3, 1, 0], dtype=torch.int32, device=DEVICE)
    extrema = kmin.clone(), kmax.clone()
    keys = quest_keys(q, k, kmin, kmax, positions, page)
    ref = quest_keys_ref(q, k, *extrema, positions, page)
    assert torch.equal(kmin, extrema[0]) and torch.equal(kmax, extrema[1])  # the same page refreshed alike
    current = positions.long().repeat_interleave(Hkv)[:, None] // page
    pages = torch.arange(NP, device=DEVICE)
    assert torch.equal(keys[pages < current], ref[pages < current])
    assert bool((keys[pages == current] == 0).all())  # the query's own page is not scored (the select forces it)
    last = (positions.long() - 1).clamp_min(0)
    for row in range(B):  # the refreshed page holds exactly the extrema of its committed slots
        p = int(last[row]) // page
        live = k[row, :, p * page:int(positions[row])]
        if live.shape[1]:
            assert torch.equal(kmin[row, :, p], live.amin(1)) and torch.equal(kmax[row, :, p], live.amax(1))


@pytest.mark.parametrize("page,KP,width", [(16, 5, 80), (7, 9, 60), (1, 12, 12), (5, 3, 11)])
def test_expand_pages_equals_reference(page, KP, width):
    g = torch.Generator().manual_seed(page * 100 + KP)
    B, Hkv = 3, 2
    positions = torch.tensor([page * KP - 1, page * (KP - 1), page * 2 + 1], dtype=torch.int32)
    count = torch.randint(1, KP + 1, (B * Hkv,), generator=g).int()
    pages = torch.zeros(B * Hkv, KP, dtype=torch.int32)
    for r in range(B * Hkv):  # increasing pages, the query's own page last
        own = int(positions[r // Hkv]) // page
        n = min(int(count[r]), own + 1)
        count[r] = n
        pages[r, :n] = torch.cat([torch.randperm(own, generator=g)[:n - 1].sort().values, torch.tensor([own])])
    pages, count, positions = pages.to(DEVICE), count.to(DEVICE), positions.to(DEVICE)
    ref_idx, ref_count = expand_pages_ref(pages, count, positions, page, width)
    out = torch.full((B * Hkv, width), -1, dtype=torch.int32, device=DEVICE), torch.zeros(B * Hkv, dtype=torch.int32,
                                                                                         device=DEVICE)
    attended = torch.zeros(B, device=DEVICE)
    idx, n = expand_pages(pages, count, positions, page, out, attended)
    assert torch.equal(n, ref_count)
    for r in range(B * Hkv):
        assert torch.equal(idx[r, :n[r]], ref_idx[r, :n[r]])
        want = sorted(s for p in pages[r, :count[r]].tolist() for s in range(p * page, (p + 1) * page)
                      if s <= positions[r // Hkv])
        assert idx[r, :n[r]].tolist() == want[:width]
    assert torch.allclose(attended, ref_count.view(B, Hkv).float().mean(-1))
