"""Sparse flash-decoding: one decode query per row attends to selected KV-cache slots (GQA, split-K).

    _partial_kernel   grid (B * Hkv, splits): one KV head's query group over a chunk of its selected slots
                      -> per-split running max m, sum l and unnormalised output acc (fp32, log2 domain)
    _merge_kernel     grid (B * Hq,): log-sum-exp merge of the splits -> out
    _block_partial_kernel  grid (row tiles, B * Hkv, splits): a block of queries a row over a chunk of the cache
                      (a speculative verify; causal, tree or sliding-window masks), merged as above per query
    _sparse_block_kernel   grid (row tiles, B * Hkv, splits): a block of queries a row over a chunk of a selection
                      and the slots after it (a cascade's sparse verify pass), merged as above per query

Every launch parameter is a function of shapes alone (no read-back), so a caller can capture it in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .launch import chained, wait_inputs

LOG2E = 1.4426950408889634
# a split streams at least this many BLOCK_N index blocks. One: at short contexts a step's attention is bound by
# latency, not bytes (H200, 1.5B shape, 2k slots: the compiled decode step 1.868 -> 1.790 ms against 2; 0.5B
# 1.098 -> 1.035; BinaryPC's sparse attention at 32k x 1 8.8 -> 6.8 us; longer ones unchanged)
MIN_BLOCKS_PER_SPLIT = 1
PROGRAMS_PER_SM = 3  # aim for 2-4 partial programs per multiprocessor
MERGE_BLOCK_S = 64  # splits merged per step
LONG_SPLIT = 2048  # `split_span` from which a power-of-two group's decode step reads 128-key blocks
INVARIANT_TILE = 16  # (head, query) rows a program of the fixed-chunk block attention (one MMA tile's rows)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@dataclass(frozen=True)
class BlockTiles:
    """How `block_attention` launches: (head, query) rows a program (a tile of rows >= 16), key slots a loop step,
    warps and pipeline stages a program. `block_tiles` chooses them from shapes; `bench/block_attention_sweep.py`
    times others."""

    rows: int
    keys: int
    warps: int = 4
    stages: int = 3

    def __post_init__(self):
        for name in ("rows", "keys"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"BlockTiles.{name} must be a power of two >= 16, got {v}")
        if self.warps not in (1, 2, 4, 8, 16) or self.stages < 1:
            raise ValueError(f"BlockTiles needs warps in 1, 2, 4, 8, 16 and stages >= 1, got {self}")


@triton.jit
def _kv_rows(k_base, v_base, slots, valid, stride_ks, stride_vs, offs_d, DOT: tl.constexpr):
    """K and V rows of `slots` [N] (zeros where not `valid`) -> k_tile, v_tile [N, D] in the dot dtype."""
    mask = valid[:, None]
    k_tile = tl.load(k_base + slots[:, None] * stride_ks + offs_d[None, :], mask=mask, other=0.0)
    v_tile = tl.load(v_base + slots[:, None] * stride_vs + offs_d[None, :], mask=mask, other=0.0)
    return k_tile.to(DOT), v_tile.to(DOT)


@triton.jit
def _softmax_step(m_i, l_i, acc, s, v_tile, V_DTYPE: tl.constexpr, DOT: tl.constexpr):
    """One block of the online softmax: scores s [R, N] (log2 domain, -inf where not attended), v_tile [N, D] ->
    the running max m [R], sum l [R] and unnormalised output acc [R, D] (fp32) after it. A row that has seen no
    slot yet keeps m = -inf and zeros."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(V_DTYPE).to(DOT)  # rounded to v's dtype (the interpreter then widens it again)
    return m_new, l_i, acc * alpha[:, None] + tl.dot(p, v_tile, input_precision="ieee")


@triton.jit
def _key_block(m_i, l_i, acc, q_tile, k_base, v_base, slots, valid, seen, qk_scale, stride_ks, stride_vs, offs_d,
               V_DTYPE: tl.constexpr, DOT: tl.constexpr):
    """One key block of an attention kernel (the block, sparse decode and sparse block ones): K/V rows `slots` [N]
    (zeros where not `valid`), scores of q_tile [R, D] against them, -inf where not `seen` [R, N] (or [1, N]) -> the
    online softmax's m, l, acc after it."""
    k_tile, v_tile = _kv_rows(k_base, v_base, slots, valid, stride_ks, stride_vs, offs_d, DOT)
    s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee") * qk_scale  # [R, N]
    s = tl.where(seen, s, float("-inf"))
    return _softmax_step(m_i, l_i, acc, s, v_tile, V_DTYPE, DOT)


@triton.jit
def _partial_kernel(q, k, v, idx, count, m_part, l_part, acc_part, qk_scale, chunk, PARTS,
                    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                    stride_ib, stride_ih, stride_cb, stride_ch,
                    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_N: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    h = pid % HKV
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    in_group = offs_g < G
    heads = h * G + offs_g  # query heads of KV head h (rows >= G are padding)

    q_ptrs = q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=in_group[:, None], other=0.0).to(DOT)  # [BLOCK_G, D]
    k_base = k + b * stride_kb + h * stride_kh
    v_base = v + b * stride_vb + h * stride_vh
    idx_base = idx + b * stride_ib + h * stride_ih
    n = tl.load(count + b * stride_cb + h * stride_ch)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)  # columns [lo, hi) are this program's valid selection

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        valid = cols < hi
        slots = tl.load(idx_base + cols, mask=valid, other=0)  # [BLOCK_N]
        m_i, l_i, acc = _key_block(m_i, l_i, acc, q_tile, k_base, v_base, slots, valid, valid[None, :], qk_scale,
                                   stride_ks, stride_vs, offs_d, v.dtype.element_ty, DOT)

    part = (b * (HKV * G) + heads) * PARTS + split  # [BLOCK_G] rows of m_part / l_part
    tl.store(m_part + part, m_i, mask=in_group)
    tl.store(l_part + part, l_i, mask=in_group)
    tl.store(acc_part + part[:, None] * D + offs_d[None, :], acc, mask=in_group[:, None])


@triton.jit
def _merge_kernel(m_part, l_part, acc_part, out, splits, D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # b * Hq + query head
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    base = row * splits

    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        cur = base + s0 + offs_s
        live = s0 + offs_s < splits
        m = tl.load(m_part + cur, mask=live, other=float("-inf"))  # [BLOCK_S]
        l = tl.load(l_part + cur, mask=live, other=0.0)
        acc_tile = tl.load(acc_part + cur[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: every weight is 0, not NaN
        alpha = tl.exp2(m_run - m_ref)
        w = tl.exp2(m - m_ref)  # [BLOCK_S]
        l_run = l_run * alpha + tl.sum(w * l, 0)
        acc = acc * alpha + tl.sum(w[:, None] * acc_tile, 0)  # [D]
        m_run = m_new
    o = acc / tl.where(l_run > 0, l_run, 1.0)  # count 0 everywhere -> zeros
    tl.store(out + row * D + offs_d, o.to(out.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def num_splits(k_cols: int, groups: int, head_dim: int, device: torch.device) -> int:
    """Splits of the K selection columns for `groups` = B * Hkv partial programs: about PROGRAMS_PER_SM programs
    per multiprocessor, each streaming at least MIN_BLOCKS_PER_SPLIT index blocks. Shapes only (graph-safe)."""
    blocks = triton.cdiv(max(k_cols, 1), _block_n(head_dim))
    want = triton.cdiv(PROGRAMS_PER_SM * _sm_count(torch.device(device)), groups)
    splits = max(1, min(want, blocks // MIN_BLOCKS_PER_SPLIT))
    return triton.cdiv(blocks, triton.cdiv(blocks, splits))  # no trailing split left without columns


def sparse_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                            count: torch.Tensor, scale: float | None = None, splits: int | None = None,
                            extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of one decode query per row over selected KV slots (GQA), split-K flash-decoding in Triton.

    q      [B, Hq, D]       bf16/fp16/fp32, contiguous; query head h uses KV head h // (Hq // Hkv)
    k, v   [B, Hkv, S, D]   q's dtype; read only at the selected slots
    idx    [B, Hkv, K]      int32 slots; only the first count[b, h] columns are read (the rest may be garbage)
    count  [B, Hkv]         int32 in [0, K]; 0 gives a zero output for the head group
    scale  softmax scale (default D ** -0.5); splits: split-K factor (default `num_splits`, from shapes only)
    extra  (m [B, Hq], l [B, Hq], acc [B, Hq, D]) fp32 or None: further terms of each head's softmax (Double-P's
           centroid terms), merged as one more split: they add e^m · acc to the numerator and e^m · l to the
           denominator (m in the logits' units; -inf with l = 0 and acc = 0: none)
    -> out [B, Hq, D]       q's dtype; softmax(q k_j * scale) v_j over the valid slots j, fp32 accumulation
    """
    B, Hq, D = q.shape
    Hkv, K = idx.shape[1], idx.shape[2]
    G = Hq // Hkv
    assert Hq == G * Hkv and k.shape[:2] == v.shape[:2] == (B, Hkv) and k.shape[-1] == v.shape[-1] == D
    assert q.is_contiguous() and k.stride(-1) == v.stride(-1) == idx.stride(-1) == 1
    assert idx.dtype == count.dtype == torch.int32 and k.dtype == v.dtype == q.dtype
    scale = D**-0.5 if scale is None else scale
    block_n = _block_n(D)
    splits = num_splits(K, B * Hkv, D, q.device) if splits is None else splits
    chunk = triton.cdiv(triton.cdiv(max(K, 1), block_n), splits) * block_n  # columns per split

    parts = splits + (extra is not None)
    m_part = torch.empty(B, Hq, parts, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, parts, dtype=torch.float32, device=q.device)
    acc_part = torch.empty(B, Hq, parts, D, dtype=torch.float32, device=q.device)
    if extra is not None:  # the last part: the merge's log2 domain
        m_part[..., splits] = extra[0] * LOG2E
        l_part[..., splits] = extra[1]
        acc_part[..., splits, :] = extra[2]
    _partial_kernel[(B * Hkv, splits)](
        q, k, v, idx, count, m_part, l_part, acc_part, scale * LOG2E, chunk, parts,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        idx.stride(0), idx.stride(1), count.stride(0), count.stride(1),
        HKV=Hkv, G=G, D=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=block_n,
        # the interpreter (CPU tensors) multiplies bf16 as raw integers in tl.dot: do its dots in fp32
        DOT=tl.float32 if q.device.type == "cpu" else _TL_DTYPES[q.dtype], num_warps=4, num_stages=3,
        **chained(q.device))
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    _merge_kernel[(B * Hq,)](m_part, l_part, acc_part, out, parts, D=D,
                             BLOCK_S=min(MERGE_BLOCK_S, triton.next_power_of_2(parts)), num_warps=4,
                             **chained(q.device))
    return out


def sparse_decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                                count: torch.Tensor, scale: float | None = None,
                                extra: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Torch reference of `sparse_decode_attention` (gather, fp32 math, masked softmax).

    q [B, Hq, D], k/v [B, Hkv, S, D], idx [B, Hkv, K] (valid below count), count [B, Hkv], extra as there
    -> [B, Hq, D] q's dtype
    """
    B, Hq, D = q.shape
    Hkv, K = idx.shape[1], idx.shape[2]
    valid = torch.arange(K, device=idx.device) < count[..., None]  # [B, Hkv, K]
    gather = torch.where(valid, idx, 0).long()[..., None].expand(-1, -1, -1, D)
    ks, vs = k.gather(2, gather).float(), v.gather(2, gather).float()  # [B, Hkv, K, D]
    qg = q.view(B, Hkv, Hq // Hkv, D).float()  # [B, Hkv, G, D]
    logits = qg @ ks.transpose(-1, -2) * (D**-0.5 if scale is None else scale)  # [B, Hkv, G, K]
    logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
    none = logits.new_full(logits.shape[:-1], float("-inf"))  # [B, Hkv, G]
    m, l, acc = (extra[0].view(B, Hkv, -1), extra[1].view(B, Hkv, -1), extra[2].view(B, Hkv, -1, D)) \
        if extra is not None else (none, 0.0, 0.0)
    top = torch.maximum(logits.amax(-1) if K else none, m)  # [B, Hkv, G]
    top = top.masked_fill(torch.isinf(top), 0.0)  # nothing attended: zeros
    p, w = (logits - top[..., None]).exp(), (m - top).exp()  # [B, Hkv, G, K], [B, Hkv, G]
    den = p.sum(-1) + w * l
    out = (p @ vs + w[..., None] * acc) / den.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.view(B, Hq, D).to(q.dtype)


# ---------------------------------------------------------------------------------------------- block queries

@triton.jit
def _row_tile(q, positions, stride_qb, stride_qh, stride_qt, stride_pb, HKV: tl.constexpr, G: tl.constexpr,
              T: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr, DOT: tl.constexpr):
    """A block program's rows: grid (row tiles, B * Hkv, splits), the row tiles fastest (one KV head's split side by
    side: its K/V read once) -> b, h, offs_r [BLOCK_R] (rows r = g * T + t: query head g of KV head h, query t of
    the block), live (not padding), t, q_tile [BLOCK_R, D] in the dot dtype, pos [BLOCK_R] (positions[b, t]; -1 on
    padding)."""
    pid = tl.program_id(1)
    b = (pid // HKV).to(tl.int64)
    h = pid % HKV
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, D)
    live = offs_r < G * T
    g, t = offs_r // T, offs_r % T
    q_ptrs = q + b * stride_qb + (h * G + g)[:, None] * stride_qh + t[:, None] * stride_qt + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=live[:, None], other=0.0).to(DOT)
    pos = tl.load(positions + b * stride_pb + t, mask=live, other=-1)
    return b, h, offs_r, live, t, q_tile, pos


@triton.jit
def _store_rows(m_part, l_part, acc_part, b, h, offs_r, live, m_i, l_i, acc, HKV: tl.constexpr, G: tl.constexpr,
                T: tl.constexpr, D: tl.constexpr):
    """A block program's online-softmax state (m, l [BLOCK_R], acc [BLOCK_R, D]) -> its split's slot of the
    [B, Hq, T, splits] partial buffers, for the merge."""
    part = ((b * HKV + h) * (G * T) + offs_r) * tl.num_programs(2) + tl.program_id(2)  # [BLOCK_R]
    tl.store(m_part + part, m_i, mask=live)
    tl.store(l_part + part, l_i, mask=live)
    tl.store(acc_part + part[:, None] * D + tl.arange(0, D)[None, :], acc, mask=live[:, None])


@triton.jit
def _block_partial_kernel(q, k, v, positions, tree, m_part, l_part, acc_part, qk_scale, chunk, window,
                          stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                          stride_vs, stride_pb, stride_tb,
                          HKV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, TREE: tl.constexpr,
                          WINDOW: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    split = tl.program_id(2)
    b, h, offs_r, live, t, q_tile, pos = _row_tile(q, positions, stride_qb, stride_qh, stride_qt, stride_pb,
                                                   HKV, G, T, D, BLOCK_R, DOT)  # pos: row r sees slots <= pos
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    if TREE:  # the block's slots from its first query's on: only those of the query's ancestor bits
        base = tl.load(positions + b * stride_pb)
        anc = tl.load(tree + b * stride_tb + t, mask=live, other=0)  # [BLOCK_R] int64
        pos = tl.where(live, base + T - 1, -1)
    k_base = k + b * stride_kb + h * stride_kh
    v_base = v + b * stride_vb + h * stride_vh
    lo = split * chunk
    hi = tl.minimum(lo + chunk, tl.max(pos, 0) + 1)  # slots [lo, hi) of this program that any row sees
    # slots below `everyone` are seen by every row of the tile (the context of a block: all but its last key
    # blocks), so their key blocks need no per-row mask: the mask's compares (a tree's 64-bit ancestor shifts) are
    # paid on the key blocks from `full` on only. The key blocks start where they did, a masked score is -inf either
    # way, and the unmasked loop keeps a (column) select between the scale and the softmax's subtraction as the
    # masked loops have, so that no path lets the compiler fuse them into one rounding (an FMA): the result is the
    # same to the bit whichever loop a key block falls in (a decode step and a verify column split them apart)
    if TREE:
        everyone = base
    else:
        everyone = tl.min(tl.where(live, pos, tl.max(pos, 0)), 0) + 1  # (padding rows: no lower bound)
    full = lo + tl.maximum(tl.minimum(hi, everyone) - lo, 0) // BLOCK_N * BLOCK_N
    first, full_lo = lo, lo  # key blocks [first, full_lo) masked (a window's lower edge), [full_lo, full) not
    if WINDOW:  # row r sees slots (pos - window, pos]: the key blocks below every row's window are skipped
        low = pos - window + 1  # [BLOCK_R]
        lowest = tl.min(tl.where(live, low, hi), 0)  # slots below it are no row's (not even read: zeros)
        first = lo + tl.maximum(lowest - lo, 0) // BLOCK_N * BLOCK_N
        full_lo = lo + (tl.maximum(tl.max(tl.where(live, low, lo), 0) - lo, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    if WINDOW:
        for start in range(first, tl.minimum(full_lo, hi), BLOCK_N):
            slots = start + offs_n
            valid = (slots < hi) & (slots >= lowest)
            seen = valid[None, :] & (slots[None, :] <= pos[:, None]) & (slots[None, :] >= low[:, None])
            m_i, l_i, acc = _key_block(m_i, l_i, acc, q_tile, k_base, v_base, slots, valid, seen, qk_scale,
                                       stride_ks, stride_vs, offs_d, v.dtype.element_ty, DOT)
    for start in range(full_lo, full, BLOCK_N):
        slots = start + offs_n
        valid = slots < hi  # (always true: see above)
        m_i, l_i, acc = _key_block(m_i, l_i, acc, q_tile, k_base, v_base, slots, valid, valid[None, :], qk_scale,
                                   stride_ks, stride_vs, offs_d, v.dtype.element_ty, DOT)
    for start in range(tl.maximum(full_lo, full), hi, BLOCK_N):
        slots = start + offs_n
        valid = slots < hi
        seen = valid[None, :] & (slots[None, :] <= pos[:, None])
        if WINDOW:
            seen = seen & (slots[None, :] >= low[:, None])
        if TREE:
            rel = slots - base  # [BLOCK_N]: block index, negative in the context
            bit = (anc[:, None] >> tl.maximum(rel, 0).to(tl.int64)[None, :]) & 1
            seen = seen & ((rel < 0)[None, :] | (bit == 1))
        m_i, l_i, acc = _key_block(m_i, l_i, acc, q_tile, k_base, v_base, slots, valid, seen, qk_scale,
                                   stride_ks, stride_vs, offs_d, v.dtype.element_ty, DOT)
    _store_rows(m_part, l_part, acc_part, b, h, offs_r, live, m_i, l_i, acc, HKV, G, T, D)


def split_span(S: int, splits: int) -> int:
    """The cache slots each of `splits` splits of S slots spans in 128-key blocks (`block_tiles`' split_slots)."""
    return triton.cdiv(triton.cdiv(max(S, 1), 128), splits) * 128


def block_tiles(G: int, T: int, D: int, dtype: torch.dtype, fixed: bool, split_slots: int = 0) -> BlockTiles:
    """The launch of a block of T queries a row, G query heads a KV head, head_dim D: all G * T rows in one tile
    (rounded up to a power of two) so that each K/V row is read once per KV head, up to the caps below (a larger
    block takes several tiles, which read the same K/V mostly from L2) — or, with fixed chunks (`fixed`), tiles of
    INVARIANT_TILE rows whatever G * T is. `split_slots`: `split_span` of the planned splits (0: not known, or keys
    read by index as in `sparse_block_attention`, which keeps the 64-key block)."""
    keys = _block_n(D)
    if T == 1 and D == 128 and dtype.itemsize == 2 and G & (G - 1) == 0 and split_slots >= LONG_SPLIT and not fixed:
        # decode steps whose query-head group is a power of two read a 128-key block: 0.85-0.90 of the 64-key
        # launch's time at 16x25.6k and 4x25.6k for heads 16/8, 32/8, 64/8, 8/2, 8/4, 16/4 (H100; 0.76-0.83 for
        # Llama-3.1-8B's 32/8 on the H200, 1x128k too), where groups of 3, 6 and 7 (24/8, 48/8, 12/2, 28/4) take
        # 0.95-1.04 (10-15% more for 12/2 on the H200). Only over long splits: the 8B's 1x32k (768 slots a split)
        # took 1.21x in one H200 sweep (docs/results/sparse_gpu.md, forty-first and forty-second sessions); only in
        # 16-bit dtypes (fp32 tiles of 128 keys spill registers)
        return BlockTiles(16, 128, 4, 2)
    if fixed:
        # one tile shape (and so one MMA shape and one reduction layout) for a decode step's rows and a verify
        # block's: a tile of G * T rows rounded up to a power of two sums a row's scores in another order. The
        # price: each of a block's G * T / 16 tiles reads the split's K/V (side by side, so mostly from L2)
        return BlockTiles(INVARIANT_TILE, keys, 4, 2)
    # decode steps (T = 1) over a full cache, H200: 2 stages 128 / 480 / 472 us at 1x128k / 4x128k / 16x32k
    # against 143 / 574 / 540 with 3 (cuDNN SDPA: 133 / 478 / 475). Verify blocks of one 16-row tile take 2 as
    # well: 0.91-1.00 of 3 stages' time for 2- and 4-wide blocks of heads 32/8, 16/8 and 8/2 and 8-wide of 16/8 at
    # 16x25.6k, 4x25.6k and 1x32k (H100, forty-third session); larger blocks keep 3 (32-row tiles of 32/8, 8/2 and
    # the 1.5B's 12/2 took 1.11-1.24x with 2 at batch 4 and 16, 0.90-0.92 at batch 1)
    # A tile's fp32 accumulator holds at most 64 x 128 values (4 warps' registers): 6 x 16 = 96 rows at head_dim 128
    # (the 1.5B's width-16 verify) took 239 / 91 / 46 us in one 128-row tile at 16x25.6k / 4x25.6k / 1x32k against
    # 170 / 62 / 34 in two of 64 (H200, docs/results/sparse_gpu.md, thirty-eighth session). Its queries then take at
    # most 32 KiB, so that they and 3 stages of K/V fit in shared memory (an fp32 block of 7 x 32 rows at head_dim
    # 128 had asked 321 KiB of the H200's 227 before a cap)
    rows = min(max(16, triton.next_power_of_2(G * T)), max(16, 8192 // D))
    return BlockTiles(rows, keys, 4, 2 if T == 1 or G * T <= 16 else 3)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    scale: float | None = None, splits: int | None = None, chunk: int = 0,
                    tree: torch.Tensor | None = None, tiles: BlockTiles | None = None,
                    window: int = 0) -> torch.Tensor:
    """A few query positions per row over the KV cache (a speculative verify block, GQA), split-K in Triton: every
    query head of a KV head and every position of the block in one tile (up to `block_tiles`' caps), so each K/V
    row is read once per KV head.

    q          [B, Hq, T, D]   bf16/fp16/fp32 (any strides but the last); query head h uses KV head h // (Hq // Hkv)
    k, v       [B, Hkv, S, D]  q's dtype; slots [0, max(positions[b]) + 1) of row b are read
    positions  [B, T]          int; query t of row b sees slots 0..positions[b, t] (causal over the cache)
    tree       [B, T] int64 or None: a tree of queries (a tree verify): query t of row b sees the slots before its
               block's, positions[b, 0] (the context), and of the block's slots positions[b, 0] + j those whose bit j
               is set in tree[b, t] (its ancestors and itself); `positions` then only places the block (T <= 63)
    -> out     [B, Hq, T, D]   q's dtype (contiguous), fp32 accumulation
    chunk      0: split S for the device's parallelism (`num_splits`); else slots a split, a multiple of the key
               block: splits at fixed slots whatever S, B and T are, and the (head, query) rows in tiles of
               INVARIANT_TILE whatever G · T is, so a query's result is bitwise the same over caches of different
               capacities (a speculative loop's cache is a block longer than plain decoding's), batches of any
               size and blocks of any width (row-invariant steps: a verify column computes what the decode step
               of its token does)
    tiles      the launch (default `block_tiles`; with `chunk`, its keys must divide the chunk)
    window     0, or a sliding window: query t of row b sees slots positions[b, t] - window < j <= positions[b, t]
               only (the key blocks below every query's window are not read; not with `tree`)
    Launches depend on shapes alone: capturable in a CUDA graph."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    assert Hq == G * Hkv and k.shape == v.shape and k.shape[0] == B and k.shape[-1] == D
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and positions.shape == (B, T)
    assert tree is None or (tree.shape == (B, T) and tree.dtype == torch.int64 and T < 64)
    if window < 0 or (window and tree is not None):
        raise ValueError(f"block_attention's window must be >= 0 (0: none) and without a tree, got {window}")
    scale = D**-0.5 if scale is None else scale
    fixed = chunk > 0
    if not fixed and splits is None:  # (the split count plans with the default key block, whatever the tiles)
        splits = num_splits(S, B * Hkv, D, q.device)
    if tiles is None:
        tiles = block_tiles(G, T, D, q.dtype, fixed, split_slots=0 if fixed else split_span(S, splits))
    if fixed:
        if chunk % tiles.keys:
            raise ValueError(f"block_attention's chunk must be a multiple of {tiles.keys} slots, got {chunk}")
        if tiles.rows != INVARIANT_TILE:  # (another tile height sums a row's scores in another order)
            raise ValueError(f"block_attention's fixed chunks tile {INVARIANT_TILE} rows, got {tiles.rows}")
        splits = triton.cdiv(max(S, 1), chunk)
    else:
        chunk = triton.cdiv(triton.cdiv(max(S, 1), tiles.keys), splits) * tiles.keys
    programs = triton.cdiv(G * T, tiles.rows)
    positions = positions.contiguous()
    m_part = torch.empty(B, Hq, T, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, T, splits, dtype=torch.float32, device=q.device)
    acc_part = torch.empty(B, Hq, T, splits, D, dtype=torch.float32, device=q.device)
    tree_arg = positions if tree is None else tree.contiguous()
    _block_partial_kernel[(programs, B * Hkv, splits)](
        q, k, v, positions, tree_arg, m_part, l_part, acc_part, scale * LOG2E, chunk, window,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), positions.stride(0), tree_arg.stride(0),
        HKV=Hkv, G=G, T=T, D=D, BLOCK_R=tiles.rows, BLOCK_N=tiles.keys,
        DOT=tl.float32 if q.device.type == "cpu" else _TL_DTYPES[q.dtype], num_warps=tiles.warps,
        num_stages=tiles.stages, TREE=tree is not None, WINDOW=window > 0, **chained(q.device))
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    # (fixed chunks: a fixed merge tile too, so that a cache with more, empty, splits merges alike)
    block_s = MERGE_BLOCK_S if fixed else min(MERGE_BLOCK_S, triton.next_power_of_2(splits))
    _merge_kernel[(B * Hq * T,)](m_part, l_part, acc_part, out, splits, D=D, BLOCK_S=block_s, num_warps=4,
                                 **chained(q.device))
    return out


def block_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        scale: float | None = None, tree: torch.Tensor | None = None,
                        window: int = 0) -> torch.Tensor:
    """Torch reference of `block_attention` (fp32 math, the causal or tree mask over slots, a sliding window)."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.float().reshape(B, Hkv, Hq // Hkv * T, D)  # rows g * T + t
    logits = qg @ k.float().transpose(-1, -2) * (D**-0.5 if scale is None else scale)  # [B, Hkv, G*T, S]
    from ..attention.dense import causal_mask, tree_mask

    seen = (causal_mask(positions.long(), S, window or None) if tree is None
            else tree_mask(positions[:, 0], tree, S)[:, None])  # [B, 1, T, S]
    seen = seen.expand(B, Hq // Hkv, T, S).reshape(B, 1, Hq // Hkv * T, S)
    probs = logits.masked_fill(~seen, float("-inf")).softmax(-1)
    return (probs @ v.float()).view(B, Hq, T, D).to(q.dtype)



# ------------------------------------------------------------------------------------- sparse block queries

@triton.jit
def _sparse_block_kernel(q, k, v, idx, count, after, positions, m_part, l_part, acc_part, qk_scale, span, S,
                         stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh,
                         stride_vs, stride_ib, stride_ih, stride_cb, stride_ch, stride_pb,
                         HKV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    split = tl.program_id(2)
    b, h, offs_r, live, t, q_tile, pos = _row_tile(q, positions, stride_qb, stride_qh, stride_qt, stride_pb,
                                                   HKV, G, T, D, BLOCK_R, DOT)  # pos: row r sees tail slots <= pos
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    last = tl.minimum(tl.max(pos, 0), S - 1)  # no slot past the cache is read
    k_base = k + b * stride_kb + h * stride_kh
    v_base = v + b * stride_vb + h * stride_vh
    idx_base = idx + b * stride_ib + h * stride_ih
    n = tl.load(count + b * stride_cb + h * stride_ch)
    first = tl.load(after + b) + 1 - n  # column c >= n is slot first + c: the slots after the selection's
    # the splits share this head's n + span columns (not the plan's width: a serving plan's is the whole capacity)
    chunk = tl.cdiv(tl.cdiv(n + span, BLOCK_N), tl.num_programs(2)) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n + span)  # columns [lo, hi): the selection's below n, the tail's from n on

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        chosen = cols < n
        slots = tl.where(chosen, tl.load(idx_base + cols, mask=chosen & (cols < hi), other=0), first + cols)
        valid = (cols < hi) & (chosen | (slots <= last))  # [BLOCK_N]: read
        seen = valid[None, :] & (chosen[None, :] | (slots[None, :] <= pos[:, None]))  # [BLOCK_R, BLOCK_N]
        m_i, l_i, acc = _key_block(m_i, l_i, acc, q_tile, k_base, v_base, slots, valid, seen, qk_scale,
                                   stride_ks, stride_vs, offs_d, v.dtype.element_ty, DOT)
    _store_rows(m_part, l_part, acc_part, b, h, offs_r, live, m_i, l_i, acc, HKV, G, T, D)


def sparse_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                           count: torch.Tensor, after: torch.Tensor, positions: torch.Tensor, span: int,
                           scale: float | None = None, splits: int | None = None) -> torch.Tensor:
    """A block of queries a row over a selection and the slots after it (a cascade's sparse verify pass, GQA),
    split-K in Triton: every query head of a KV head and every query of the block in one tile (up to
    `block_tiles`' caps), so each selected K/V row is read once per KV head, and only the count[b, h] selected.

    q          [B, Hq, T, D]  bf16/fp16/fp32 (any strides but the last); query head h uses KV head h // (Hq // Hkv)
    k, v       [B, Hkv, S, D] q's dtype; read only at the selected slots and the tail below
    idx        [B, Hkv, K]    int32 slots; the first count[b, h] columns are attended by every query of the block
    count      [B, Hkv]       int32 in [0, K]
    after      [B]            int: the slot the selection was made at; the `span` slots after it, after[b] + 1 ..
                              after[b] + span (the tail), are attended by query t where <= positions[b, t]
    positions  [B, T]         int, each < S
    -> out     [B, Hq, T, D]  q's dtype (contiguous); fp32 accumulation
    splits     split-K factor (default `num_splits` of K + span columns, from shapes only); each (row, KV head)
               shares its own count + span columns among them
    Launches depend on shapes alone: capturable in a CUDA graph."""
    B, Hq, T, D = q.shape
    Hkv, K = idx.shape[1], idx.shape[2]
    G = Hq // Hkv
    assert Hq == G * Hkv and k.shape[:2] == v.shape[:2] == (B, Hkv) and k.shape[-1] == v.shape[-1] == D
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == idx.stride(-1) == 1 and positions.shape == (B, T)
    assert idx.dtype == count.dtype == torch.int32 and k.dtype == v.dtype == q.dtype and span >= 0
    scale = D**-0.5 if scale is None else scale
    tiles = block_tiles(G, T, D, q.dtype, False)
    if T > 1:  # (the gathers of a sparse pass were timed with 3 stages; the 16-row tiles' 2 are the dense kernel's)
        tiles = replace(tiles, stages=3)
    splits = num_splits(K + span, B * Hkv, D, q.device) if splits is None else splits
    positions, after = positions.contiguous(), after.contiguous()
    m_part = torch.empty(B, Hq, T, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty(B, Hq, T, splits, dtype=torch.float32, device=q.device)
    acc_part = torch.empty(B, Hq, T, splits, D, dtype=torch.float32, device=q.device)
    _sparse_block_kernel[(triton.cdiv(G * T, tiles.rows), B * Hkv, splits)](
        q, k, v, idx, count, after, positions, m_part, l_part, acc_part, scale * LOG2E, span, k.shape[2],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), idx.stride(0), idx.stride(1), count.stride(0), count.stride(1), positions.stride(0),
        HKV=Hkv, G=G, T=T, D=D, BLOCK_R=tiles.rows, BLOCK_N=tiles.keys,
        DOT=tl.float32 if q.device.type == "cpu" else _TL_DTYPES[q.dtype], num_warps=tiles.warps,
        num_stages=tiles.stages, **chained(q.device))
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    _merge_kernel[(B * Hq * T,)](m_part, l_part, acc_part, out, splits, D=D,
                                 BLOCK_S=min(MERGE_BLOCK_S, triton.next_power_of_2(splits)), num_warps=4,
                                 **chained(q.device))
    return out


def sparse_block_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor,
                               count: torch.Tensor, after: torch.Tensor, positions: torch.Tensor, span: int,
                               scale: float | None = None) -> torch.Tensor:
    """Torch reference of `sparse_block_attention` (gather, fp32 math, masked softmax); its arguments as there."""
    B, Hq, T, D = q.shape
    Hkv, K = idx.shape[1], idx.shape[2]
    S = k.shape[2]
    chosen = torch.arange(K, device=idx.device) < count[..., None]  # [B, Hkv, K]
    tail = after.long()[:, None] + 1 + torch.arange(span, device=idx.device)  # [B, span]
    slots = torch.cat([torch.where(chosen, idx, 0).long(), tail.clamp(max=S - 1)[:, None].expand(B, Hkv, span)], -1)
    seen = torch.cat([chosen[:, :, None].expand(B, Hkv, T, K),
                      (tail[:, None] <= positions.long()[:, :, None])[:, None].expand(B, Hkv, T, span)], -1)
    gather = slots[..., None].expand(-1, -1, -1, D)
    ks, vs = k.gather(2, gather).float(), v.gather(2, gather).float()  # [B, Hkv, K + span, D]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, T, D)
    logits = qg @ ks[:, :, None].transpose(-1, -2) * (D**-0.5 if scale is None else scale)  # [B, Hkv, G, T, K+span]
    logits = logits.masked_fill(~seen[:, :, None], float("-inf"))
    if K + span == 0:  # nothing to attend to: zeros
        return torch.zeros_like(q, memory_format=torch.contiguous_format)
    top = logits.amax(-1, keepdim=True)
    p = (logits - top.masked_fill(torch.isinf(top), 0.0)).exp()  # nothing attended: zeros
    out = (p @ vs[:, :, None]) / p.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return out.view(B, Hq, T, D).to(q.dtype)
