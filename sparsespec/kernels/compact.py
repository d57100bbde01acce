"""Compacting a tree verify's accepted path in the KV cache: one launch for every layer's K and V.

A tree verify writes its n + 1 block tokens at slots length .. length + n of each row, in block order (parents before
children); the target accepts one root-to-node path, whose block indices (the set bits of that node's ancestor mask,
ascending) must end up at slots length, length + 1, ... as a line verify would have left them. The kernel moves them
there for all layers at once: the cache's per-layer tensors are reached through a table of their addresses, one
program per (tensor, row, KV head) walks the block in order (a path's j-th slot moves to a lower or equal slot, and
every slot it writes was read before, so one program per row and head needs no second buffer)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _compact_kernel(table, lengths, bits, stride_b, stride_h, stride_s,
                    WIDTH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DTYPE: tl.constexpr):
    t, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base = tl.load(table + t).to(tl.pointer_type(DTYPE)) + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    start = tl.load(lengths + b).to(tl.int64)
    mask = tl.load(bits + b)
    d = tl.arange(0, BLOCK_D)
    kept = 0  # path slots placed so far
    for j in range(WIDTH):
        on = ((mask >> j) & 1) != 0
        live = d < tl.where(on & (kept != j), D, 0)  # [BLOCK_D]: the row moves (a path slot not yet in place)
        x = tl.load(base + (start + j) * stride_s + d, mask=live)
        tl.store(base + (start + kept) * stride_s + d, x, mask=live)
        kept += on.to(tl.int32)


def compact_path(k: list[torch.Tensor], v: list[torch.Tensor], lengths: torch.Tensor, bits: torch.Tensor,
                 width: int, table: torch.Tensor | None = None) -> None:
    """In place, every layer: row b's slots lengths[b] + j whose bit j is set in bits[b] (j < width), ascending, to
    slots lengths[b], lengths[b] + 1, ...; the other slots of the block are left as they were or overwritten.

    k, v     L tensors [B, Hkv, S, D] each, one dtype and one stride layout (a `KVCache`'s)
    lengths  [B] int64   each row's first block slot (the pending token's)
    bits     [B] int64   bit j: block index j is on the path (bit 0, the root, always; all bits set: nothing moves)
    table    [2L] int64  the tensors' addresses, k then v (`address_table`); built here when not given
    Launches depend on shapes alone: capturable in a CUDA graph (with a table built before capture)."""
    ref = k[0]
    B, Hkv, S, D = ref.shape
    assert len(k) == len(v) and all(t.shape == ref.shape and t.stride() == ref.stride() for t in k + v)
    assert ref.stride(-1) == 1 and lengths.shape == bits.shape == (B,) and 1 <= width <= 63
    table = address_table(k, v) if table is None else table
    _compact_kernel[(2 * len(k), B, Hkv)](table, lengths, bits, ref.stride(0), ref.stride(1), ref.stride(2),
                                           WIDTH=width, D=D, BLOCK_D=triton.next_power_of_2(D),
                                           DTYPE=_TL_DTYPES[ref.dtype], num_warps=1)


def address_table(k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
    """[2L] int64: the addresses of k's tensors, then v's, on their device (valid while they live)."""
    return torch.tensor([t.data_ptr() for t in k + v], dtype=torch.int64).to(k[0].device)


def compact_path_ref(k: list[torch.Tensor], v: list[torch.Tensor], lengths: torch.Tensor, bits: torch.Tensor,
                     width: int) -> None:
    """`compact_path` in torch (the CPU path and the test oracle): per tensor, the block's slots are read whole, the
    path's first, and written back whole."""
    B = lengths.shape[0]
    j = torch.arange(width, device=lengths.device)
    on = (bits[:, None] >> j & 1) != 0  # [B, width]
    order = torch.where(on, j, j + width).argsort(1)  # [B, width]: the path's block indices first, ascending
    rows, slots = torch.arange(B, device=lengths.device)[:, None], lengths[:, None] + j
    for t in k + v:
        t[rows, :, slots] = t[rows, :, slots.gather(1, order)]  # [B, width, Hkv, D]
