"""The Triton path compaction of a tree verify's K/V against its torch reference (interpreted on CPU, native on CUDA),
and the cache method that picks between them."""

import pytest
import torch

pytest.importorskip("triton")

from sparsespec.cache import KVCache  # noqa: E402
from sparsespec.config import ModelConfig  # noqa: E402
from sparsespec.kernels.compact import address_table, compact_path, compact_path_ref  # noqa: E402

from .conftest import DEVICE  # noqa: E402


def case(L, B, H, S, D, width, dtype, seed):
    """L layers of random K/V [B, H, S, D], random block starts with room for `width` slots, and random paths (bit 0
    set); row 0 all bits (nothing moves), row 1 the root alone."""
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(B, H, S, D, generator=gen).to(DEVICE, dtype) for _ in range(L)]
    v = [torch.randn(B, H, S, D, generator=gen).to(DEVICE, dtype) for _ in range(L)]
    starts = torch.randint(0, S - width + 1, (B,), generator=gen)
    bits = torch.randint(0, 2**width, (B,), generator=gen) | 1
    bits[0] = -1
    if B > 1:
        bits[1] = 1
    return k, v, starts.to(DEVICE), bits.to(DEVICE)


def expected(k, v, starts, bits, width):
    """Per tensor and row: the path's slots, ascending, at starts[b] on; every slot outside the block unchanged."""
    out = []
    for t in k + v:
        t = t.clone()
        for b, (s, m) in enumerate(zip(starts.tolist(), bits.tolist())):
            path = [j for j in range(width) if m >> j & 1]
            t[b, :, s:s + len(path)] = t[b, :, [s + j for j in path]]
        out.append(t)
    return out


def check(got, want, before, starts, bits, width, who=""):
    """got equals want on each row's slots before its block's dead part, and `before` on the slots past the block."""
    for g, w, o in zip(got, want, before):
        for b, (s, m) in enumerate(zip(starts.tolist(), bits.tolist())):
            n = bin(m & (2**width - 1)).count("1")
            assert torch.equal(g[b, :, :s + n], w[b, :, :s + n]), (who, b)
            assert torch.equal(g[b, :, s + width:], o[b, :, s + width:]), (who, b)


@pytest.mark.parametrize("L,B,H,S,D,width,dtype", [
    (3, 2, 2, 70, 128, 16, torch.bfloat16), (2, 3, 1, 40, 64, 32, torch.float32), (1, 1, 3, 20, 80, 5, torch.float16),
    (4, 5, 2, 33, 16, 9, torch.float32)])
def test_compact_path_equals_reference_and_moves_only_the_block(L, B, H, S, D, width, dtype):
    """Kernel and reference against a per-row Python walk: the path's slots in order from the block's start, every
    slot outside the block untouched; past the path, inside the block, either may leave anything (dead slots)."""
    k, v, starts, bits = case(L, B, H, S, D, width, dtype, seed=L * 100 + width)
    want = expected(k, v, starts, bits, width)
    for fn in (compact_path, compact_path_ref):
        kk, vv = [t.clone() for t in k], [t.clone() for t in v]
        if fn is compact_path:
            fn(kk, vv, starts, bits, width, address_table(kk, vv))
        else:
            fn(kk, vv, starts, bits, width)
        check(kk + vv, want, k + v, starts, bits, width, fn.__name__)


def test_cache_compact_moves_every_layer_and_a_row_view_keeps_its_own_addresses():
    """`KVCache.compact` (the kernel on a GPU, the reference on a CPU) moves every layer's K and V; a view of some
    rows (`rows`) compacts its own rows, not the first rows of the whole cache."""
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position=64)
    cache = KVCache(cfg, 3, 40, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(5)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in cache.k + cache.v]
    starts, bits = torch.tensor([3, 10, 0], device=DEVICE), torch.tensor([0b1011, -1, 0b10001], device=DEVICE)
    want = expected(cache.k, cache.v, starts, bits, 6)
    cache.compact(starts, bits, 6)
    check(cache.k + cache.v, want, before, starts, bits, 6)
    view = cache.rows(1, 3)  # rows 1 and 2 of the whole cache
    for got, old in zip(cache.k + cache.v, before):
        got.copy_(old)
    starts, bits = torch.tensor([0, 4], device=DEVICE), torch.tensor([0b101, 0b11], device=DEVICE)
    view.compact(starts, bits, 3)
    rest = [t[1:] for t in before]
    want = expected(rest[:len(cache.k)], rest[len(cache.k):], starts, bits, 3)
    check([t[1:] for t in cache.k + cache.v], want, rest, starts, bits, 3)
    assert all(torch.equal(got[0], old[0]) for got, old in zip(cache.k + cache.v, before))
