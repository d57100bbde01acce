"""Fixed-width top-k selection over integer keys by radix select: no sort, forced slots first.

    keys   [R, S]  int16 / int32   R = B * Hkv rows (row-major over (row, KV head)), S = cache capacity.
                                   Unsigned keys of `key_bits` bits, higher = more important; 0 = never attend.
    -> idx [R, K]  int32           the selected slots of each row in slot order; columns past count[r] are garbage
       count [R]   int32

Per row r (batch row b = r // Hkv, decode query at positions[b]), only slots 0..positions[b] exist. Forced in (key
set to the maximum): the first `sinks` slots, the recent `window` slots ending at the query (at least the query's
own slot), slots >= forced_from[b], and the first extra_n[b] slots listed in extra[r] (a policy's own forced list,
e.g. BinaryPC's safeguard). The row attends to count = min(max(tokens[b], forced), candidates, K) slots: the
forced ones, then the highest keys, ties to the lower slot — the same set `select_top` picks.

One program per row: one pass per 8-bit digit builds the digit's histogram among the keys that match the digits
chosen so far and finds the digit where the running count from the top crosses the budget; a last pass writes the
keys above the threshold, and the first keys equal to it in slot order, compacted with a prefix sum. Every pass
reads the keys once (2 or 4 bytes a slot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _keys_block(row_ptr, start, n, pos, forced_from, SINKS, WINDOW, KEY_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """Keys of slots [start, start + BLOCK) as int64, forced slots at KEY_MASK, slots past the query at 0."""
    s = start + tl.arange(0, BLOCK)
    inb = s < n
    key = tl.load(row_ptr + s, mask=inb, other=0).to(tl.int64) & KEY_MASK
    forced = (s < SINKS) | (s > pos - WINDOW) | (s >= forced_from)
    key = tl.where(forced, KEY_MASK, key)
    return s, tl.where(inb, key, 0)


@triton.jit
def _crossing(hist, k):
    """hist [256] counts per digit, k >= 1 wanted from the top -> (digit where the count from the top reaches k,
    how many are still wanted among the keys of that digit)."""
    bins = tl.arange(0, 256)
    suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with digit >= d
    t = tl.sum((suffix >= k).to(tl.int32), 0) - 1
    above = tl.sum(tl.where(bins > t, hist, 0), 0)
    return t.to(tl.int64), k - above


@triton.jit
def _select_kernel(keys_ptr, positions_ptr, tokens_ptr, forced_from_ptr, extra_ptr, extra_n_ptr, idx_ptr, count_ptr,
                   S, K, E, SINKS, WINDOW, HKV: tl.constexpr, KEY_BITS: tl.constexpr, HAS_EXTRA: tl.constexpr,
                   BLOCK: tl.constexpr, EBLOCK: tl.constexpr):
    r = tl.program_id(0)
    b = r // HKV
    pos = tl.load(positions_ptr + b).to(tl.int32)
    n = pos + 1
    forced_from = tl.load(forced_from_ptr + b).to(tl.int32)
    row = keys_ptr + r.to(tl.int64) * S
    KEY_MASK: tl.constexpr = (1 << KEY_BITS) - 1
    DIGITS: tl.constexpr = KEY_BITS // 8
    bins = tl.arange(0, 256)

    if HAS_EXTRA:  # the policy's forced list: written into the row as maximal keys before the first pass
        n_extra = tl.load(extra_n_ptr + b)
        for j0 in range(0, E, EBLOCK):
            j = j0 + tl.arange(0, EBLOCK)
            slot = tl.load(extra_ptr + r.to(tl.int64) * E + j, mask=j < n_extra, other=0)
            tl.store(row + slot, tl.full([EBLOCK], -1, tl.int32).to(keys_ptr.dtype.element_ty),
                     mask=(j < n_extra) & (slot <= pos))
        tl.debug_barrier()

    # top digit: histogram of the candidates, forced and candidate counts
    hist = tl.zeros([256], dtype=tl.int32)
    skipped = 0
    n_forced = 0
    for start in range(0, n, BLOCK):
        s, key = _keys_block(row, start, n, pos, forced_from, SINKS, WINDOW, KEY_MASK, BLOCK)
        valid = key > 0
        n_forced += tl.sum((key == KEY_MASK).to(tl.int32), 0)
        digit = tl.where(valid, (key >> (KEY_BITS - 8)) & 255, 0).to(tl.int32)
        hist += tl.histogram(digit, 256)
        skipped += tl.sum((~valid).to(tl.int32), 0)
    hist -= tl.where(bins == 0, skipped, 0)
    candidates = tl.sum(hist, 0)
    want = tl.minimum(tl.minimum(tl.maximum(tl.load(tokens_ptr + b).to(tl.int32), n_forced), candidates), K)
    prefix, k = _crossing(hist, tl.maximum(want, 1))

    for d in tl.static_range(1, DIGITS):  # the lower digits, among the keys that match the prefix so far
        shift = KEY_BITS - 8 * (d + 1)
        hist = tl.zeros([256], dtype=tl.int32)
        skipped = 0
        for start in range(0, n, BLOCK):
            s, key = _keys_block(row, start, n, pos, forced_from, SINKS, WINDOW, KEY_MASK, BLOCK)
            match = (key > 0) & ((key >> (shift + 8)) == prefix)
            hist += tl.histogram(tl.where(match, (key >> shift) & 255, 0).to(tl.int32), 256)
            skipped += tl.sum((~match).to(tl.int32), 0)
        hist -= tl.where(bins == 0, skipped, 0)
        t, k = _crossing(hist, k)
        prefix = prefix * 256 + t

    # compaction in slot order: every key above the threshold, the first k keys equal to it
    out = 0
    ties = 0
    for start in range(0, n, BLOCK):
        s, key = _keys_block(row, start, n, pos, forced_from, SINKS, WINDOW, KEY_MASK, BLOCK)
        valid = key > 0
        eq = valid & (key == prefix)
        take = (valid & (key > prefix)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) - 1 < k))
        dst = out + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(idx_ptr + r.to(tl.int64) * K + dst, s, mask=take & (dst < want))
        out += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(eq.to(tl.int32), 0)
    tl.store(count_ptr + r, tl.minimum(out, want))


def select_topk(keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, forced_from: torch.Tensor,
                k: int, key_bits: int, sinks: int = 0, window: int = 0, extra: torch.Tensor | None = None,
                extra_n: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """keys [R, S] int16/int32 (the forced list is written into it), positions / tokens / forced_from [B] int32
    or int64, extra [R, E] int32 with extra_n [B] -> (idx [R, k] int32, count [R] int32). `key_bits` is 16 or 32
    (int16 keys: 16). Shapes alone fix the launch: capturable in a CUDA graph."""
    R, S = keys.shape
    assert key_bits in (16, 32) and keys.dtype == (torch.int16 if key_bits == 16 else torch.int32)
    B = positions.shape[0]
    idx, count = out if out is not None else (torch.empty(R, k, dtype=torch.int32, device=keys.device),
                                              torch.empty(R, dtype=torch.int32, device=keys.device))
    has_extra = extra is not None and extra.shape[1] > 0
    E = extra.shape[1] if has_extra else 0
    _select_kernel[(R,)](
        keys, positions, tokens, forced_from, extra if has_extra else count, extra_n if has_extra else count,
        idx, count, S, k, E, sinks, max(window, 1), HKV=R // B, KEY_BITS=key_bits, HAS_EXTRA=has_extra,
        BLOCK=min(2048, triton.next_power_of_2(S)), EBLOCK=min(256, triton.next_power_of_2(max(E, 1))),
        num_warps=8)
    return idx, count


def select_topk_ref(keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, forced_from: torch.Tensor,
                    k: int, key_bits: int, sinks: int = 0, window: int = 0, extra: torch.Tensor | None = None,
                    extra_n: torch.Tensor | None = None):
    """The torch reference of `select_topk` (same arguments; keys are not modified). Returns idx in slot order."""
    R, S = keys.shape
    B = positions.shape[0]
    top = (1 << key_bits) - 1
    rows = lambda t: t.long().repeat_interleave(R // B)[:, None]  # noqa: E731  [B] -> [R, 1]
    pos = rows(positions)
    slots = torch.arange(S, device=keys.device)
    key = keys.long() & top
    forced = (slots < sinks) | (slots > pos - max(window, 1)) | (slots >= rows(forced_from))
    if extra is not None and extra.shape[1] > 0:
        listed = torch.arange(extra.shape[1], device=keys.device) < rows(extra_n)
        spill = torch.zeros(R, S + 1, dtype=torch.bool, device=keys.device)  # column S takes the unlisted
        forced = forced | spill.scatter(1, torch.where(listed, extra.long(), S), True)[:, :S]
    key = torch.where(slots <= pos, torch.where(forced, top, key), 0)  # [R, S]
    want = torch.minimum(torch.maximum(rows(tokens), (key == top).sum(-1, keepdim=True)),
                         (key > 0).sum(-1, keepdim=True)).clamp_max(k)  # [R, 1]
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower slot first
    taken = torch.arange(order.shape[1], device=keys.device) < want
    chosen = torch.where(taken, order, S)  # S sorts after every real slot
    idx = torch.zeros(R, k, dtype=torch.int32, device=keys.device)
    idx[:, :order.shape[1]] = torch.sort(chosen, dim=-1).values.int()
    return idx, want.squeeze(-1).int()


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores [..., S] -> int32 keys for `select_topk(key_bits=32)` in the same order: -inf (never attend)
    -> 0, +inf (forced) -> the maximum key, everything else in IEEE order in between."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0, a tie as in a sort
    unsigned = torch.where(bits >= 0, bits | (1 << 31), ~bits & 0xFFFFFFFF)  # IEEE order as unsigned integers
    unsigned = torch.where(scores == float("-inf"), 0, torch.where(scores == float("inf"), 0xFFFFFFFF, unsigned))
    return (unsigned - ((unsigned >> 31) << 32)).int()  # the same 32 bits as a signed int32
