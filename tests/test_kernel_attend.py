"""The Triton sparse flash-decoding kernel against its torch reference and SDPA (interpreted on CPU, native on CUDA)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from sparsespec.kernels.attend import (  # noqa: E402
    LONG_SPLIT, MIN_BLOCKS_PER_SPLIT, PROGRAMS_PER_SM, BlockTiles, _block_n, block_attention, block_attention_ref,
    block_tiles, num_splits, sparse_block_attention, sparse_block_attention_ref, sparse_decode_attention,
    sparse_decode_attention_ref, split_span,
)

from .conftest import DEVICE, cuda_only  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def make_case(B, Hkv, G, S, D, K, dtype, seed, device=DEVICE):
    """Random q/k/v, a distinct slot selection per (row, KV head) with garbage past count, and counts: row 0 all
    0, row 1 all K, later rows random in [0, K]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, D, generator=gen).to(device, dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(device, dtype)
    count = torch.randint(0, K + 1, (B, Hkv), generator=gen, dtype=torch.int32)
    count[0], count[1] = 0, K
    slots = torch.rand(B, Hkv, S, generator=gen).argsort(-1)[..., :K].int()  # [B, Hkv, K]
    garbage = torch.randint(-2**31, 2**31 - 1, (B, Hkv, K), generator=gen, dtype=torch.int32)
    idx = torch.where(torch.arange(K) < count[..., None], slots, garbage)
    return q, k, v, idx.to(device), count.to(device)


def poisoned(monkeypatch):
    """Make every float torch.empty NaN-filled, so output or partial buffers the kernels fail to write show up."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()  # 0 when both 0


def check(monkeypatch, B, Hkv, G, S, D, K, dtype, splits, seed, scale=None):
    q, k, v, idx, count = make_case(B, Hkv, G, S, D, K, dtype, seed)
    with monkeypatch.context() as mp:
        poisoned(mp)
        out = sparse_decode_attention(q, k, v, idx, count, scale=scale, splits=splits)
    ref = sparse_decode_attention_ref(q, k, v, idx, count, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    assert (out[0] == 0).all()  # count 0 -> zeros
    assert rel_err(out, ref) < TOL[dtype]


#  B, Hkv, G,  S,   D,   K,   dtype,          splits
CASES = [
    (2, 1, 1, 37, 64, 1, torch.float32, 1),
    (3, 2, 4, 37, 64, 37, torch.float32, None),  # K = S: every slot selectable
    (3, 2, 7, 37, 128, 20, torch.bfloat16, 1),
    (3, 1, 4, 37, 64, 37, torch.bfloat16, 8),  # more splits than index blocks: empty splits
    (3, 2, 1, 300, 64, 300, torch.float32, 3),
    (2, 2, 7, 300, 64, 129, torch.float32, 2),
    (3, 1, 7, 300, 128, 300, torch.bfloat16, None),
    (3, 2, 4, 300, 128, 250, torch.bfloat16, 4),
    (2, 1, 4, 300, 64, 65, torch.float16, 1),
    (3, 2, 1, 300, 128, 191, torch.float16, 3),
    (2, 2, 4, 300, 128, 77, torch.float32, 2),
    (3, 1, 1, 300, 64, 300, torch.bfloat16, 5),
    (2, 2, 3, 37, 16, 37, torch.float32, 2),
    (3, 1, 2, 300, 256, 150, torch.bfloat16, 3),
    (2, 1, 4, 37, 64, 0, torch.float32, None),  # nothing selected anywhere
    (2, 1, 4, 300, 64, 300, torch.float32, 70),  # more splits than one merge step takes
]


@pytest.mark.parametrize("B,Hkv,G,S,D,K,dtype,splits", CASES)
def test_matches_reference(monkeypatch, B, Hkv, G, S, D, K, dtype, splits):
    check(monkeypatch, B, Hkv, G, S, D, K, dtype, splits, seed=1000 * K + S + D + G)


@pytest.mark.parametrize("B,Hkv,G,S,D,K,dtype,splits", [(3, 2, 4, 37, 64, 30, torch.float32, 2),
                                                        (3, 1, 7, 300, 128, 129, torch.bfloat16, None),
                                                        (2, 2, 1, 300, 64, 0, torch.float32, 1)])
def test_extra_terms_merge_like_one_softmax(monkeypatch, B, Hkv, G, S, D, K, dtype, splits):
    """Extra softmax terms (Double-P's centroids): one more split of the merge. Rows with no selected slot (row 0)
    output the extra terms alone; heads without extra terms (m = -inf) the slots alone; nothing at all, zeros."""
    q, k, v, idx, count = make_case(B, Hkv, G, S, D, K, dtype, seed=S + K + G)
    gen = torch.Generator().manual_seed(K)
    Hq = Hkv * G
    m = (torch.randn(B, Hq, generator=gen) * 3).to(DEVICE)
    m[:, 0] = float("-inf")
    l = torch.rand(B, Hq, generator=gen).to(DEVICE) * 50 * ~torch.isinf(m)
    acc = torch.randn(B, Hq, D, generator=gen).to(DEVICE) * l[..., None]
    with monkeypatch.context() as mp:
        poisoned(mp)
        out = sparse_decode_attention(q, k, v, idx, count, splits=splits, extra=(m, l, acc))
    ref = sparse_decode_attention_ref(q, k, v, idx, count, extra=(m, l, acc))
    assert not out.isnan().any() and rel_err(out, ref) < TOL[dtype]
    assert rel_err(out[0, 1:], acc[0, 1:] / l[0, 1:, None]) < TOL[dtype]  # the extra terms alone
    assert (out[0, 0] == 0).all()  # nothing at all
    plain = sparse_decode_attention_ref(q, k, v, idx, count)
    assert torch.equal(ref[1:, 0], plain[1:, 0])  # no extra terms: the slots alone


def test_custom_scale(monkeypatch):
    check(monkeypatch, 3, 1, 4, 37, 64, 30, torch.float32, 2, seed=1, scale=0.37)


@pytest.mark.parametrize("G,D,dtype", [(1, 64, torch.float32), (4, 128, torch.float32), (7, 64, torch.bfloat16)])
def test_all_slots_equal_sdpa(G, D, dtype):
    """idx = arange(S), count = S: dense attention over the whole cache."""
    B, Hkv, S = 2, 2, 150
    q, k, v, _, _ = make_case(B, Hkv, G, S, D, 1, dtype, seed=7)
    idx = torch.arange(S, dtype=torch.int32, device=DEVICE).expand(B, Hkv, S).contiguous()
    count = torch.full((B, Hkv), S, dtype=torch.int32, device=DEVICE)
    out = sparse_decode_attention(q, k, v, idx, count)
    kr, vr = (t.float().repeat_interleave(G, dim=1) for t in (k, v))  # [B, Hq, S, D]
    dense = F.scaled_dot_product_attention(q.float()[:, :, None], kr, vr)[:, :, 0]
    assert rel_err(out, dense) < TOL[dtype]


@pytest.mark.parametrize("K,groups,D", [(1, 1, 64), (4096, 1, 128), (32768, 8, 128), (65536, 512, 128),
                                       (1000, 3, 256), (37, 4, 64)])
def test_split_heuristic(K, groups, D):
    """A plain int from shapes: enough programs to fill the SMs when K allows, each split at least
    MIN_BLOCKS_PER_SPLIT index blocks, and no split left without columns."""
    splits = num_splits(K, groups, D, torch.device("cpu"))
    blocks = -(-K // _block_n(D))
    chunk = -(-blocks // splits)
    assert type(splits) is int and 1 <= splits and (splits - 1) * chunk < blocks
    assert splits == 1 or chunk >= MIN_BLOCKS_PER_SPLIT
    assert splits * groups >= min(132 * PROGRAMS_PER_SM * 0.9, groups * blocks // MIN_BLOCKS_PER_SPLIT)


@cuda_only
@pytest.mark.parametrize("dtype,splits", [(torch.bfloat16, None), (torch.float16, 70), (torch.float32, None)])
@pytest.mark.parametrize("G,D", [(4, 128), (8, 64), (5, 256)])
def test_cuda_large(monkeypatch, dtype, splits, G, D):
    check(monkeypatch, 5, 8, G, 20_000 + 37, D, 4_099, dtype, splits, seed=G * D)


@cuda_only
def test_cuda_graph_replay_follows_new_selection():
    """Captured once, replayed after idx/count change in place: no host read of tensor values in the call."""
    q, k, v, idx, count = make_case(4, 8, 4, 5_000, 128, 1_024, torch.bfloat16, seed=3)
    sparse_decode_attention(q, k, v, idx, count)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_decode_attention(q, k, v, idx, count)
    for seed in (4, 5):
        _, _, _, new_idx, new_count = make_case(4, 8, 4, 5_000, 128, 1_024, torch.bfloat16, seed=seed)
        idx.copy_(new_idx)
        count.copy_(new_count)
        graph.replay()
        assert rel_err(out, sparse_decode_attention_ref(q, k, v, idx, count)) < 1e-2


@pytest.mark.parametrize("B,Hkv,G,T,S,D,dtype", [
    (2, 2, 4, 16, 100, 64, torch.bfloat16), (1, 1, 7, 3, 37, 16, torch.float32), (3, 2, 1, 5, 130, 128, torch.float16),
    (2, 3, 6, 2, 65, 32, torch.float32), (3, 2, 4, 1, 90, 64, torch.bfloat16), (4, 1, 3, 1, 33, 32, torch.float32),
    (1, 1, 4, 1, 2 * LONG_SPLIT + 70, 128, torch.float16)])  # (the last: one split of 128-key blocks)
def test_block_attention_equals_reference_and_sdpa(B, Hkv, G, T, S, D, dtype):
    """Verify blocks (and decode steps, T = 1) at each row's own offset (one ending at the last slot, one at the
    first slots), and positions in any order; q strided as the model projects it; one split and several. The slots
    past a row's last position are dead: what they hold changes nothing, to the bit."""
    gen = torch.Generator().manual_seed(B * 100 + T * 10 + D)
    q = torch.randn(B, T, Hkv * G, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)  # [B, Hq, T, D] strided
    k = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    starts = torch.randint(0, S - T + 1, (B,), generator=gen)
    starts[0] = S - T
    if B > 1:
        starts[1] = 0
    positions = (starts[:, None] + torch.arange(T)).to(DEVICE)  # [B, T]
    if B > 2:
        positions[2] = torch.randint(0, S, (T,), generator=gen).to(DEVICE)
    ref = block_attention_ref(q, k, v, positions)
    mask = torch.arange(S, device=DEVICE) <= positions[:, None, :, None]
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=G > 1)
    assert torch.allclose(ref.float(), sdpa, atol=TOL[dtype], rtol=TOL[dtype])
    for splits in (None, 3, 1):
        out = block_attention(q, k, v, positions, splits=splits)
        assert out.shape == (B, Hkv * G, T, D) and out.dtype == dtype
        assert torch.allclose(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype]), splits
    dead = torch.arange(S, device=DEVICE) > positions.max(1).values[:, None]  # [B, S]
    k[dead[:, None].expand_as(k[..., 0])] = 1e4
    v[dead[:, None].expand_as(v[..., 0])] = float("nan")
    assert torch.equal(block_attention(q, k, v, positions, splits=1), out)  # (the loop's last: one split)


@pytest.mark.parametrize("B,Hkv,G,T,S,D,dtype", [
    (2, 2, 3, 5, 77, 64, torch.bfloat16), (1, 1, 4, 16, 40, 32, torch.float32), (3, 2, 1, 9, 130, 16, torch.float16),
    (2, 1, 7, 32, 70, 128, torch.float32)])
def test_block_attention_over_a_tree_equals_reference_and_sdpa(B, Hkv, G, T, S, D, dtype):
    """A tree verify block (a tree chosen by `spec.tree.choose` from random marginals): each query sees the context
    and its ancestors only; against the reference and SDPA with the same mask, one split and several, fixed chunks;
    a straight line as a tree is the causal block, to the bit."""
    from sparsespec.attention.dense import tree_mask
    from sparsespec.spec.tree import Pool, choose

    gen = torch.Generator().manual_seed(B * 100 + T * 10 + D)
    q = torch.randn(B, T, Hkv * G, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    base = torch.randint(0, S - T + 1, (B,), generator=gen)
    base[0] = S - T
    positions = (base[:, None] + torch.arange(T)).to(DEVICE)
    logp, ids = torch.randn(B, T - 1, 50, generator=gen).log_softmax(-1).topk(3, -1)
    tree = choose(Pool.of(T - 1), ids, logp, T - 1).ancestors.to(DEVICE)
    ref = block_attention_ref(q, k, v, positions, tree=tree)
    mask = tree_mask(positions[:, 0], tree, S)[:, None]
    sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=G > 1)
    assert torch.allclose(ref.float(), sdpa, atol=TOL[dtype], rtol=TOL[dtype])
    for splits, chunk in ((None, 0), (1, 0), (3, 0), (None, 64)):
        out = block_attention(q, k, v, positions, splits=splits, chunk=chunk, tree=tree)
        assert torch.allclose(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype]), (splits, chunk)
    line = ((torch.ones(T, dtype=torch.long) << torch.arange(1, T + 1)) - 1).to(DEVICE).expand(B, -1)
    assert torch.equal(block_attention(q, k, v, positions, tree=line), block_attention(q, k, v, positions))


@pytest.mark.parametrize("D,dtype", [(64, torch.bfloat16), (32, torch.float32), (128, torch.float16)])
def test_block_attention_in_fixed_chunks_is_bitwise_the_same_over_any_capacity_batch_and_block(D, dtype):
    """With `chunk` the splits sit at fixed slots: a query's output is bitwise the same whether the cache holds
    S or more slots (a speculative loop's cache is a block longer than plain decoding's), whatever other rows share
    the batch and whether the query is alone (a decode step) or any column of a block (a verify step; here 5
    queries of a group of 3 heads: 15 rows, and 36 in the wider block below, tiled alike); and it stays within the
    reference's tolerance. A chunk that is no multiple of the key block is refused."""
    gen = torch.Generator().manual_seed(D)
    Hkv, G, S, chunk = 2, 3, 300, 2 * _block_n(D)
    q = torch.randn(3, Hkv * G, 5, D, generator=gen).to(DEVICE, dtype)  # [B, Hq, T, D]
    k = torch.randn(3, Hkv, S + 90, D, generator=gen).to(DEVICE, dtype)  # room past S
    v = torch.randn(3, Hkv, S + 90, D, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([[S - 5, S - 4, S - 3, S - 2, S - 1], [100, 101, 102, 103, 104],
                              [3, 4, 5, 6, 7]], device=DEVICE)  # [B, T]
    out = block_attention(q, k[:, :, :S], v[:, :, :S], positions, chunk=chunk)  # [B, Hq, T, D]
    ref = block_attention_ref(q, k[:, :, :S], v[:, :, :S], positions)
    assert torch.allclose(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    longer = block_attention(q, k, v, positions, chunk=chunk)  # more slots, more (empty) splits
    assert torch.equal(longer, out)
    for r in range(3):  # each row alone, each of its queries alone (a decode step's shape)
        for t in range(5):
            alone = block_attention(q[r:r + 1, :, t:t + 1], k[r:r + 1, :, :S + 7], v[r:r + 1, :, :S + 7],
                                    positions[r:r + 1, t:t + 1], chunk=chunk)
            assert torch.equal(alone, out[r:r + 1, :, t:t + 1]), (r, t)
    wide = torch.randn(3, Hkv * G, 12, D, generator=gen).to(DEVICE, dtype)  # a 12-wide block: 36 rows a head
    wide_positions = positions[:, :1] + torch.arange(12, device=DEVICE)  # [B, 12]
    block = block_attention(wide, k, v, wide_positions, chunk=chunk)
    for r, t in ((0, 0), (0, 11), (1, 6), (2, 10)):
        alone = block_attention(wide[r:r + 1, :, t:t + 1], k[r:r + 1], v[r:r + 1], wide_positions[r:r + 1, t:t + 1],
                                chunk=chunk)
        assert torch.equal(alone, block[r:r + 1, :, t:t + 1]), (r, t)
    with pytest.raises(ValueError, match="multiple"):
        block_attention(q, k, v, positions, chunk=_block_n(D) + 8)
    with pytest.raises(ValueError, match="tile 16 rows"):
        block_attention(q, k, v, positions, chunk=chunk, tiles=BlockTiles(32, _block_n(D)))


@pytest.mark.parametrize("tiles", [BlockTiles(16, 16, 4, 2), BlockTiles(32, 64, 8, 3), BlockTiles(64, 32, 8, 4),
                                   BlockTiles(128, 16, 4, 1)])
@pytest.mark.parametrize("tree", [False, True])
def test_block_attention_with_other_tiles_equals_the_reference(tiles, tree):
    """Any launch (`bench/block_attention_sweep.py` times them): rows tiled in fewer or more programs than G * T
    needs (36 rows here: 3 programs of 16, one of 64 half empty), key blocks of other sizes, a causal block or a
    tree; positions that end mid key block and one row at the cache's first slots."""
    from sparsespec.spec.tree import Pool, choose

    B, Hkv, G, T, S, D, dtype = 3, 2, 3, 12, 150, 64, torch.bfloat16
    gen = torch.Generator().manual_seed(tiles.rows + tiles.keys + tree)
    q = torch.randn(B, T, Hkv * G, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    positions = (torch.tensor([S - T, 0, 70])[:, None] + torch.arange(T)).to(DEVICE)
    anc = None
    if tree:
        logp, ids = torch.randn(B, T - 1, 50, generator=gen).log_softmax(-1).topk(3, -1)
        anc = choose(Pool.of(T - 1), ids, logp, T - 1).ancestors.to(DEVICE)
    ref = block_attention_ref(q, k, v, positions, tree=anc)
    for splits in (None, 2):
        out = block_attention(q, k, v, positions, splits=splits, tree=anc, tiles=tiles)
        assert torch.allclose(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype]), splits


def test_block_tiles_defaults_and_checks():
    """One tile of every row of a block (a power of two, capped by the accumulator's size), 2 pipeline stages for
    16-row tiles, 16-row tiles with fixed chunks; invalid launches refused."""
    assert block_tiles(6, 16, 128, torch.bfloat16, False) == BlockTiles(64, 64, 4, 3)  # 96 rows: 2 tiles of 64
    assert block_tiles(6, 8, 128, torch.bfloat16, False) == BlockTiles(64, 64, 4, 3)
    assert block_tiles(6, 1, 128, torch.bfloat16, False) == BlockTiles(16, 64, 4, 2)
    # verify blocks of one 16-row tile take 2 pipeline stages as decode steps do, larger tiles 3
    assert block_tiles(4, 4, 128, torch.bfloat16, False, split_slots=1 << 20) == BlockTiles(16, 64, 4, 2)
    assert block_tiles(6, 2, 128, torch.bfloat16, False) == BlockTiles(16, 64, 4, 2)
    assert block_tiles(4, 8, 128, torch.bfloat16, False) == BlockTiles(32, 64, 4, 3)
    assert block_tiles(6, 4, 128, torch.bfloat16, False) == BlockTiles(32, 64, 4, 3)
    assert block_tiles(4, 8, 512, torch.bfloat16, False).stages == 3  # (several 16-row tiles, capped at head_dim 512)
    # a decode step of a power-of-two group at head_dim 128 reads 128-key blocks over long splits (not over short
    # ones or slots read by index, split_slots 0, nor in fixed chunks)
    for G in (1, 2, 4, 8):
        assert block_tiles(G, 1, 128, torch.bfloat16, False, split_slots=LONG_SPLIT) == BlockTiles(16, 128, 4, 2)
        assert block_tiles(G, 1, 128, torch.bfloat16, False, split_slots=LONG_SPLIT - 1) == BlockTiles(16, 64, 4, 2)
        assert block_tiles(G, 1, 128, torch.bfloat16, False) == BlockTiles(16, 64, 4, 2)
        assert block_tiles(G, 1, 128, torch.bfloat16, True, split_slots=LONG_SPLIT).keys == 64
    for G, T, D, dtype in ((6, 1, 128, torch.bfloat16), (3, 1, 128, torch.float16), (4, 1, 64, torch.bfloat16),
                           (4, 4, 128, torch.bfloat16), (4, 1, 128, torch.float32)):  # (fp32: 128 keys spill)
        assert block_tiles(G, T, D, dtype, False, split_slots=1 << 20).keys == 64
    # the planned splits' span at 128 keys: the 8B's heads (8 KV heads) at 4 x 25.6k span 2,048 slots a split on a
    # 132-multiprocessor GPU (128 keys), its 1 x 32k 768 (64 keys)
    for B, S, keys in ((4, 25600, 128), (16, 25600, 128), (1, 131072, 128), (1, 32768, 64)):
        splits = num_splits(S, B * 8, 128, torch.device("cpu"))  # (the CPU plans for 132 multiprocessors)
        assert block_tiles(4, 1, 128, torch.bfloat16, False, split_slots=split_span(S, splits)).keys == keys
    assert block_tiles(7, 16, 64, torch.bfloat16, False).rows == 128  # head_dim 64: a 128 x 64 accumulator
    assert block_tiles(7, 32, 256, torch.float32, False).rows == 32  # 32 x 256 accumulator values, 32 KiB of queries
    assert block_tiles(6, 16, 128, torch.bfloat16, True) == BlockTiles(16, 64, 4, 2)
    for bad in ({"rows": 24, "keys": 64}, {"rows": 16, "keys": 8}, {"rows": 16, "keys": 16, "warps": 3},
                {"rows": 16, "keys": 16, "stages": 0}):
        with pytest.raises(ValueError):
            BlockTiles(**bad)


@pytest.mark.parametrize("window,tiles", [(w, None) for w in (1, 64, 1000)] + [
    (5, BlockTiles(16, 16, 4, 2)), (100, BlockTiles(16, 16, 4, 2)), (64, BlockTiles(16, 128, 4, 2)),
    (1000, BlockTiles(16, 128, 4, 2))])  # (in one key block, across several, wider than the cache with the default
# launch; with 16- and 128-key blocks, windows in one block and across several)
def test_block_attention_in_a_sliding_window_equals_the_reference(window, tiles):
    """A sliding window (a DFlash drafter's context window): query t sees slots (positions[t] - window,
    positions[t]] only; windows inside one key block, across several, wider than the cache; rows at the cache's
    end, its start and in the middle, a block seeing one slot for all its queries (a drafter's block) and a causal
    one; fixed chunks too. What lies below every causal row's window changes nothing, to the bit; a window with a
    tree is refused."""
    B, Hkv, G, T, S, D, dtype = 3, 2, 3, 6, 150, 32, torch.float32
    gen = torch.Generator().manual_seed(window)
    q = torch.randn(B, T, Hkv * G, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    causal = (torch.tensor([S - T, 0, 70])[:, None] + torch.arange(T)).to(DEVICE)  # [B, T]
    for positions in (causal, causal[:, -1:].expand(B, T).contiguous()):
        ref = block_attention_ref(q, k, v, positions, window=window)
        fixed = (None, 128 if tiles and tiles.keys == 128 else 64)
        # every split with the default tiles and causal rows; else the default split and fixed chunks (suite time)
        every = tiles is None and positions is causal
        for splits, chunk in ((None, 0), (1, 0), (4, 0), fixed) if every else ((None, 0), fixed):
            out = block_attention(q, k, v, positions, splits=splits, chunk=chunk, tiles=tiles, window=window)
            assert torch.allclose(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype]), (splits, chunk)
    below = torch.arange(S, device=DEVICE) <= causal.min(1).values[:, None] - window  # [B, S]
    k2, v2 = k.clone(), v.clone()
    k2[below[:, None].expand_as(k[..., 0])] = 1e4
    v2[below[:, None].expand_as(v[..., 0])] = float("nan")
    assert torch.equal(block_attention(q, k2, v2, causal, splits=3, tiles=tiles, window=window),
                       block_attention(q, k, v, causal, splits=3, tiles=tiles, window=window))
    if tiles is None:
        from sparsespec.models.transformer import block_attention as op  # (what the model calls: the custom op)

        torch.testing.assert_close(op(q, k, v, causal, 0, None, window=window),
                                   block_attention(q, k, v, causal, window=window), atol=0, rtol=0)
    with pytest.raises(ValueError, match="window"):
        block_attention(q, k, v, causal, window=-1)
    with pytest.raises(ValueError, match="window"):
        block_attention(q, k, v, causal, window=4, tree=torch.ones(B, T, dtype=torch.long, device=DEVICE))


#  B, Hkv, G,  T,  S,   D,   K,  span, dtype
SPARSE_BLOCKS = [
    (3, 2, 4, 5, 77, 64, 20, 4, torch.float32),  # a selecting pass: the tail is the block's own slots
    (2, 1, 7, 16, 150, 128, 33, 15, torch.bfloat16),
    (3, 2, 1, 1, 90, 32, 17, 0, torch.float16),  # one query, no tail: a decode step
    (2, 3, 6, 8, 200, 64, 70, 11, torch.float32),  # reusing: a tail longer than the block
    (4, 1, 3, 3, 65, 16, 0, 7, torch.bfloat16),  # nothing selected: the tail alone
    (2, 2, 5, 9, 150, 128, 129, 8, torch.float16),  # a row may select every slot up to `after`
    (2, 2, 3, 4, 600, 32, 560, 3, torch.float32),  # a plan as wide as the cache (serving), counts far below it
    pytest.param(5, 8, 4, 16, 20_037, 128, 4_099, 15, torch.bfloat16, marks=cuda_only),  # full sizes
    pytest.param(3, 2, 6, 8, 25_600, 128, 530, 7, torch.float16, marks=cuda_only),  # the 1.5B's heads
]


@pytest.mark.parametrize("B,Hkv,G,T,S,D,K,span,dtype", SPARSE_BLOCKS)
def test_sparse_block_attention_equals_reference_and_masked_sdpa(monkeypatch, B, Hkv, G, T, S, D, K, span, dtype):
    """A cascade's sparse pass: a selection made at slot `after` (distinct slots up to it, garbage past each count;
    counts 0 and K among them) and the tail after it, query t seeing tail slots up to its own position; rows whose
    block starts at the selection (a selecting pass) and past it (a reusing one); q strided as the model projects
    it; one split and several. Equals SDPA under the same mask; what no query attends to changes nothing, to the
    bit."""
    gen = torch.Generator().manual_seed(B * 1000 + T * 10 + K)
    q = torch.randn(B, T, Hkv * G, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)  # [B, Hq, T, D] strided
    k = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(DEVICE, dtype)
    after = torch.randint(max(K - 1, 0), S - span - 1, (B,), generator=gen)  # K slots up to it, the tail after
    after[0] = S - span - 1  # the tail ends at the cache's last slot
    start = after + torch.randint(0, span - T + 2, (B,), generator=gen) if span >= T else after.clone()
    start[0] = after[0]  # a selecting pass
    positions = (start[:, None] + torch.arange(T)).clamp(max=S - 1)  # [B, T]
    count = torch.randint(0, K + 1, (B, Hkv), generator=gen, dtype=torch.int32)
    count[0, 0] = K
    count[-1, -1] = 0
    chosen = torch.stack([torch.stack([torch.randperm(int(a) + 1, generator=gen)[:K] for _ in range(Hkv)])
                          for a in after]).int()  # [B, Hkv, K]: distinct slots <= after
    garbage = torch.randint(-2**31, 2**31 - 1, (B, Hkv, K), generator=gen, dtype=torch.int32)
    idx = torch.where(torch.arange(K) < count[..., None], chosen, garbage)
    idx, count, after, positions = idx.to(DEVICE), count.to(DEVICE), after.to(DEVICE), positions.to(DEVICE)

    ref = sparse_block_attention_ref(q, k, v, idx, count, after, positions, span)
    mask = torch.zeros(B, Hkv, S + 1, dtype=torch.bool, device=DEVICE)
    mask.scatter_(-1, torch.where(torch.arange(K, device=DEVICE) < count[..., None], idx, S).long(), True)
    slots = torch.arange(S, device=DEVICE)
    tail = (slots > after[:, None, None]) & (slots <= after[:, None, None] + span) & (slots <= positions[..., None])
    seen = (mask[:, :, None, :S] | tail[:, None]).repeat_interleave(G, 1)  # [B, Hq, T, S]
    sdpa = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(G, 1),
                                          v.float().repeat_interleave(G, 1), attn_mask=seen)
    sdpa = torch.where(seen.any(-1, keepdim=True), sdpa, 0.0)  # nothing attended: zeros
    assert torch.allclose(ref.float(), sdpa, atol=TOL[dtype], rtol=TOL[dtype])
    for splits in (None, 1, 3):
        with monkeypatch.context() as mp:
            poisoned(mp)
            out = sparse_block_attention(q, k, v, idx, count, after, positions, span, splits=splits)
        assert out.shape == (B, Hkv * G, T, D) and out.dtype == dtype and not out.isnan().any()
        assert torch.allclose(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype]), splits
    unseen = ~seen[:, ::G].any(2)  # [B, Hkv, S]
    k[unseen], v[unseen] = 1e4, float("nan")
    assert torch.equal(sparse_block_attention(q, k, v, idx, count, after, positions, span, splits=3), out)


def test_sparse_block_attention_over_nothing_is_zeros():
    """No selection column and no tail (K = span = 0): zeros from the kernel and the reference alike."""
    q = torch.randn(2, 4, 3, 16, device=DEVICE)
    kv = torch.randn(2, 2, 10, 16, device=DEVICE)
    idx = torch.zeros(2, 2, 0, dtype=torch.int32, device=DEVICE)
    count = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    after = torch.tensor([4, 6], device=DEVICE)
    positions = after[:, None] + torch.arange(3, device=DEVICE)
    for attend in (sparse_block_attention, sparse_block_attention_ref):
        out = attend(q, kv, kv, idx, count, after, positions, 0)
        assert out.shape == q.shape and (out == 0).all()
