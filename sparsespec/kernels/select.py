"""Fixed-width top-k selection over integer keys by radix select: no sort, forced slots first.

    keys   [R, S]  int16 / int32   R = B * Hkv rows (row-major over (row, KV head)), S = cache capacity.
                                   Unsigned keys of `key_bits` bits, higher = more important; 0 = never attend.
    -> idx [R, K]  int32           the selected slots of each row in slot order; columns past count[r] are garbage
       count [R]   int32

Per row r (batch row b = r // Hkv, decode query at positions[b]), only slots 0..positions[b] exist. Forced in (key
set to the maximum): the first `sinks` slots, the recent `window` slots ending at the query (at least the query's
own slot), slots >= forced_from[b], and the first extra_n[b] slots listed in extra[r] (a policy's own forced list,
e.g. BinaryPC's safeguard on CPU; on CUDA its scorers write it with the keys, `score_keys(extra=)`). The row
attends to count = min(max(tokens[b], forced), candidates, K) slots: the forced ones, then the highest keys, ties
to the lower slot — the same set `select_top` picks.

Radix select, every pass spread over (row, run of blocks) programs, a few per row so that the GPU is full at any
batch: one pass per digit (8 bits; the last takes the rest, `key_digits`) adds the run's histogram of that digit
(among the keys matching the digits chosen so far) to the row's; every program finds the chosen digits itself from
the row's histograms (where the count from the top crosses the budget). The last digit's pass also keeps each
program's own histogram and its count of keys above the prefix; the write pass takes its program's offset from
the earlier programs' (their keys above the threshold, and their keys equal to it, taken in slot order until the
row has its count) and writes the selection compacted in slot order. Every pass reads the keys once (2 or 4 bytes
a slot): for BinaryPC's 14-bit keys two histogram passes (256 and 64 bins), then the write.

The candidate path (keys of up to 16 bits, large selects: `takes_candidates`): one program a row finds, from one
slot in 16, a threshold a little below the row's budget; one compaction pass over the row stages the slots of the
keys at or above it, each program its own run's in slot order, with their counts; a placing pass puts them together
in a candidate buffer, in slot order with their keys, where they fit; and one program a row checks that they hold
the row's selection and selects among them (its threshold by a rank search over the candidates' keys, then the
write in slot order) — one scanning pass over the row instead of two histogram passes and the write. Rows whose
candidates fall short or overflow take the radix path in the same launches: the selection is the same on both
paths. Both one-program-a-row steps find their key by a rank search, a bit a round (`_at_least`): a compare a key
and round, where a `tl.histogram` needs several programs a row and their atomics, and is dear on Triton 3.6, which
lowers it to ballots (the radix top-digit pass: 970 PTX instructions a thread for 8 keys there, 310 on 3.9, which
adds to shared-memory bins).

The counting buffers (`select_scratch`: histograms, forced counts) start at zero and the write pass's last program
of each row zeroes them again (the candidate path's threshold: the candidates' program), so a plan keeps one
scratch for every layer and step (no memset launch a select).
(Running the first radix pass inside BinaryPC's scorer instead, over the keys it has just computed, was measured on
the H200 and was slower: 59 against 53 us a layer at 128k x 1, 468 against 447 at 128k x 16.)
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import chained, wait_inputs


@triton.jit
def _stored_keys(x, KEY_BITS: tl.constexpr):
    """Loaded keys -> their KEY_BITS bits in the keys' arithmetic type (`_key_type`)."""
    return _key_type(x, KEY_BITS) & ((1 << KEY_BITS) - 1)


@triton.jit
def _ranked_keys(s, key, pos, forced_from, SINKS, WINDOW, KEY_BITS: tl.constexpr):
    """Stored keys of slots s (`_stored_keys`) -> the keys the select ranks: forced slots at the maximal key, slots
    past the query at 0."""
    KEY_MASK: tl.constexpr = (1 << KEY_BITS) - 1
    forced = (s < SINKS) | (s > pos - WINDOW) | (s >= forced_from)
    key = tl.where(forced, KEY_MASK, key)
    return tl.where(s <= pos, key, 0)


@triton.jit
def _ranked_at(row_ptr, s, start, S, pos, forced_from, SINKS, WINDOW, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """The ranked keys of slots s (any shape) of the block [start, start + BLOCK) of a row of S slots. The load is
    masked by the row's end, not by the query's position (`_ranked_keys` zeroes the slots past it): a mask constant
    over aligned runs (S a multiple of 16, as Triton's specialisation sees it) lets each thread load its keys in one
    vector access, not one 16-bit load a key."""
    key = _stored_keys(tl.load(row_ptr + s, mask=s < S, other=0), KEY_BITS)
    if (start < SINKS) | (start + BLOCK > pos - WINDOW + 1) | (start + BLOCK > forced_from):
        # forced or future slots in the block; the others (most blocks of a long row) take the stored keys as they
        # are, a third of the operations a key: the passes over the row are bound by them as much as by memory
        key = _ranked_keys(s, key, pos, forced_from, SINKS, WINDOW, KEY_BITS)
    return key


@triton.jit
def _keys_block(row_ptr, start, S, pos, forced_from, SINKS, WINDOW, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """(slots [start, start + BLOCK) of a row of S slots, their ranked keys: `_ranked_at`)."""
    s = start + tl.arange(0, BLOCK)
    return s, _ranked_at(row_ptr, s, start, S, pos, forced_from, SINKS, WINDOW, KEY_BITS, BLOCK)


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
def _force_listed(keys_ptr, samples_ptr, extra_ptr, r, n_extra, pos, lo, hi, S, NS, E, EBLOCK: tl.constexpr,
                  STRIDE: tl.constexpr, SAMPLES: tl.constexpr):
    """The slots of row r's forced list (extra_ptr [R, E], its first n_extra, at most E) in [lo, hi) and up to pos
    written as maximal keys (all bits set); with SAMPLES, into the sampled slots' copy too (samples_ptr [R, NS])."""
    n_extra = tl.minimum(n_extra, E)
    for j0 in range(0, n_extra, EBLOCK):
        j = j0 + tl.arange(0, EBLOCK)
        slot = tl.load(extra_ptr + r.to(tl.int64) * E + j, mask=j < n_extra, other=0)
        listed = (j < n_extra) & (slot <= pos) & (slot >= lo) & (slot < hi)
        tl.store(keys_ptr + r.to(tl.int64) * S + slot, tl.full([EBLOCK], -1, tl.int32).to(
            keys_ptr.dtype.element_ty), mask=listed)
        if SAMPLES:
            at = slot // STRIDE
            tl.store(samples_ptr + r.to(tl.int64) * NS + at, tl.full([EBLOCK], -1, tl.int32).to(
                samples_ptr.dtype.element_ty), mask=listed & (slot == _jittered(at, STRIDE)))


@triton.jit
def _force_kernel(keys_ptr, samples_ptr, positions_ptr, extra_ptr, extra_n_ptr, S, NS, E, HKV: tl.constexpr,
                  EBLOCK: tl.constexpr, STRIDE: tl.constexpr, SAMPLES: tl.constexpr, PDL: tl.constexpr):
    """The policy's forced list written into each row (`_force_listed`; a scorer may write it itself instead:
    BinaryPC's, `score_keys(extra=)`)."""
    wait_inputs(PDL)
    r = tl.program_id(0)
    b = r // HKV
    _force_listed(keys_ptr, samples_ptr, extra_ptr, r, tl.load(extra_n_ptr + b), tl.load(positions_ptr + b), 0, S,
                  S, NS, E, EBLOCK, STRIDE, SAMPLES)


@triton.jit
def _threshold(hist_ptr, stats_ptr, tokens_ptr, r, b, K, DIGITS: tl.constexpr, LAST: tl.constexpr,
               UPTO: tl.constexpr):
    """From the histograms of digits 0..UPTO-1 (top first; the last digit has LAST bits, the others 8) -> (key
    prefix of those digits, how many keys wanted among those matching it, how many wanted in all)."""
    hist = tl.load(hist_ptr + (r * DIGITS) * 256 + tl.arange(0, 256))
    n_forced = tl.load(stats_ptr + r)
    want = tl.minimum(tl.minimum(tl.maximum(tl.load(tokens_ptr + b).to(tl.int32), n_forced), tl.sum(hist, 0)), K)
    prefix, k = _crossing(hist, tl.maximum(want, 1))
    for d in tl.static_range(1, UPTO):
        t, k = _crossing(tl.load(hist_ptr + (r * DIGITS + d) * 256 + tl.arange(0, 256)), k)
        prefix = (prefix << (LAST if d == DIGITS - 1 else 8)) + t
    return prefix, k, want


@triton.jit
def _key_type(x, KEY_BITS: tl.constexpr):
    """A scalar in the keys' arithmetic type (int32 up to 16 key bits, else int64)."""
    return x.to(tl.int32) if KEY_BITS <= 16 else x.to(tl.int64)


@triton.jit
def _histogram_kernel(keys_ptr, positions_ptr, tokens_ptr, forced_from_ptr, hist_ptr, stats_ptr, part_ptr, skip_ptr,
                      S, K, SINKS, WINDOW, BPP, HKV: tl.constexpr, KEY_BITS: tl.constexpr, LAST: tl.constexpr,
                      D: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr, SKIP: tl.constexpr, PDL: tl.constexpr):
    """Digit D's histogram over this program's run of BPP blocks, among the keys matching the digits above, added
    atomically to the row's. The last digit's pass also keeps the program's own histogram and how many of its keys
    lie above the prefix (part_ptr [R, P, 2^LAST + 1]): the write pass takes its offsets from them. SKIP: rows
    whose skip_ptr[r] is set are left alone (selected by the candidate path)."""
    wait_inputs(PDL)
    r = tl.program_id(0)
    p = tl.program_id(1)
    if SKIP:
        if tl.load(skip_ptr + r) != 0:
            return
    b = r // HKV
    pos = tl.load(positions_ptr + b).to(tl.int32)
    forced_from = tl.load(forced_from_ptr + b).to(tl.int32)
    KEY_MASK: tl.constexpr = (1 << KEY_BITS) - 1
    DIGITS: tl.constexpr = (KEY_BITS - LAST) // 8 + 1
    BINS: tl.constexpr = (1 << LAST) if D == DIGITS - 1 else 256
    shift: tl.constexpr = 0 if D == DIGITS - 1 else KEY_BITS - 8 * (D + 1)  # of this digit
    high: tl.constexpr = LAST if D == DIGITS - 1 else shift + 8  # of the digits above it
    if D > 0:
        prefix, k, want = _threshold(hist_ptr, stats_ptr, tokens_ptr, r, b, K, DIGITS, LAST, D)
        prefix = _key_type(prefix, KEY_BITS)
    hist = tl.zeros([BINS], dtype=tl.int32)
    n_forced = 0
    above = 0
    for i in range(BPP):
        start = (p * BPP + i) * BLOCK
        if start <= pos:
            s, key = _keys_block(keys_ptr + r.to(tl.int64) * S, start, S, pos, forced_from, SINKS, WINDOW, KEY_BITS,
                                 BLOCK)
            match = key > 0
            if D == 0:
                n_forced += tl.sum((key == KEY_MASK).to(tl.int32), 0)
            else:
                above += tl.sum(((key >> high) > prefix).to(tl.int32), 0)
                match = match & ((key >> high) == prefix)
            part = tl.histogram(tl.where(match, (key >> shift) & (BINS - 1), 0).to(tl.int32), BINS)
            hist += part - tl.where(tl.arange(0, BINS) == 0, tl.sum((~match).to(tl.int32), 0), 0)
    if D == 0:
        tl.atomic_add(stats_ptr + r, n_forced)
    tl.atomic_add(hist_ptr + (r * DIGITS + D) * 256 + tl.arange(0, BINS), hist)
    if D == DIGITS - 1:  # the program's keys of each last digit and above it (suffix sums), for the write pass
        own = part_ptr + (r * P + p).to(tl.int64) * (BINS + 1)
        tl.store(own + tl.arange(0, BINS), tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist)
        tl.store(own + BINS, above)


@triton.jit
def _write_kernel(keys_ptr, positions_ptr, tokens_ptr, forced_from_ptr, hist_ptr, stats_ptr, part_ptr, skip_ptr,
                  idx_ptr, count_ptr, attended_ptr, done_ptr, S, K, SINKS, WINDOW, BPP, HKV: tl.constexpr,
                  KEY_BITS: tl.constexpr, LAST: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, BLOCK: tl.constexpr,
                  ATTENDED: tl.constexpr, SKIP: tl.constexpr, PDL: tl.constexpr):
    """Write this program's selected slots in slot order: every key above the threshold, and the keys equal to it
    while the row still wants them. Where they start, from the earlier programs' last-digit suffix sums: their keys
    above the threshold, and their keys equal to it as far as the row takes those. One scan a block: the running
    counts of keys above the threshold and of keys equal to it, packed as the low and high 16 bits of one int32
    (BLOCK <= 2^14: `select_topk` checks it)."""
    wait_inputs(PDL)
    r = tl.program_id(0)
    p = tl.program_id(1)
    if SKIP:
        if tl.load(skip_ptr + r) != 0:
            return
    b = r // HKV
    pos = tl.load(positions_ptr + b).to(tl.int32)
    forced_from = tl.load(forced_from_ptr + b).to(tl.int32)
    DIGITS: tl.constexpr = (KEY_BITS - LAST) // 8 + 1
    BINS: tl.constexpr = 1 << LAST
    threshold, k, want = _threshold(hist_ptr, stats_ptr, tokens_ptr, r, b, K, DIGITS, LAST, DIGITS)
    t = threshold & (BINS - 1)
    threshold = _key_type(threshold, KEY_BITS)
    prog = tl.arange(0, PP)
    earlier = prog < p
    parts = part_ptr + (r * P).to(tl.int64) * (BINS + 1) + prog * (BINS + 1)  # [PP]
    from_t = tl.load(parts + t, mask=earlier, other=0)  # earlier programs' keys of last digit >= t (and prefix)
    past_t = tl.where(t + 1 < BINS, tl.load(parts + t + 1, mask=earlier, other=0), 0)  # ... > t
    ties = tl.sum(from_t - past_t, 0)  # keys equal to the threshold before this program's
    out = (tl.sum(tl.load(parts + BINS, mask=earlier, other=0), 0) + tl.sum(past_t, 0)
           + tl.minimum(ties, k))  # slots written before this program's
    for i in range(BPP):
        start = (p * BPP + i) * BLOCK
        if start <= pos:
            s, key = _keys_block(keys_ptr + r.to(tl.int64) * S, start, S, pos, forced_from, SINKS, WINDOW, KEY_BITS,
                                 BLOCK)
            above = (key > 0) & (key > threshold)
            eq = (key > 0) & (key == threshold)
            run = tl.cumsum(above.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # inclusive
            eq_upto = run >> 16
            room = tl.maximum(k - ties, 0)  # keys equal to the threshold this row still takes
            take = above | (eq & (eq_upto <= room))
            dst = out + (run & 0xFFFF) + tl.minimum(eq_upto, room) - 1
            tl.store(idx_ptr + r.to(tl.int64) * K + dst, s, mask=take & (dst < want))
            total = tl.max(run, 0)  # the running counts only grow: the last is the largest
            out += (total & 0xFFFF) + tl.minimum(total >> 16, room)
            ties += total >> 16
    if p == 0:
        tl.store(count_ptr + r, want)
        if ATTENDED:
            tl.atomic_add(attended_ptr + b, want.to(tl.float32) / HKV)
    # the row's counts back to zero for the next select (a plan's scratch serves every layer and step): by the
    # row's last program to get here, after every program of the row has read them
    tl.debug_barrier()
    if tl.atomic_add(done_ptr + r, 1) == P - 1:
        for d in tl.static_range(DIGITS):
            tl.store(hist_ptr + (r * DIGITS + d) * 256 + tl.arange(0, 256), tl.zeros([256], tl.int32))
        tl.store(stats_ptr + r, 0)
        tl.store(done_ptr + r, 0)


@triton.jit
def _jittered(j, STRIDE: tl.constexpr):
    """Sampled slot of sample j: one slot in each run of STRIDE, at an offset hashed from j (no fixed phase that a
    periodic layout of the cache could alias with)."""
    return j * STRIDE + (((j * -1640531535) >> 16) & (STRIDE - 1))


@triton.jit
def _sample_target(positions_ptr, tokens_ptr, b, K, MARGIN, STRIDE: tl.constexpr):
    """(sampled slots of row b, the sample rank the candidate threshold sits at: 5/4 of the budget's share of the
    sample, plus MARGIN, at least 1)."""
    n = tl.load(positions_ptr + b).to(tl.int32) + 1
    n_s = (n + STRIDE - 1) // STRIDE
    want = tl.minimum(tl.load(tokens_ptr + b).to(tl.int64), K)
    return n_s, tl.maximum((want * 5 * n_s + 4 * n - 1) // (4 * n) + MARGIN, 1).to(tl.int32)


@triton.jit
def _at_least(key, value):
    """[N] int32: 1 where key [N] (0 = not a key) is at or above value — the share of a rank search's count."""
    return (key >= value).to(tl.int32)


@triton.jit
def _rank_search(key, v, want, KEY_BITS: tl.constexpr):
    """The largest key at or above v that at least `want` of the keys [N] (held in registers) reach, found a bit at
    a time from the top (it lies in [v, v + 2^KEY_BITS)); v itself where no larger one is reached by so many."""
    for d in tl.static_range(KEY_BITS):
        up = v + (1 << (KEY_BITS - 1 - d))
        v = tl.where(tl.sum(_at_least(key, up), 0) >= want, up, v)
    return v


@triton.jit
def _sample_kernel(keys_ptr, samples_ptr, positions_ptr, tokens_ptr, forced_from_ptr, estimate_ptr, S, NS, K, SINKS,
                   WINDOW, MARGIN, HKV: tl.constexpr, KEY_BITS: tl.constexpr, STRIDE: tl.constexpr,
                   BLOCK: tl.constexpr, RESIDENT: tl.constexpr, SAMPLES: tl.constexpr, PDL: tl.constexpr):
    """One program a row: the candidate threshold of row r into estimate_ptr[r] — the largest key that at least the
    sample's target rank (`_sample_target`) of its keys reach, one slot in STRIDE sampled (`_jittered`), or 1
    (every live key) where fewer sampled keys are live. A rank search a bit at a time from the top (KEY_BITS
    rounds, each counting the sampled keys at or above one value), over the sample held in registers (RESIDENT: at
    most BLOCK sampled slots) or streamed BLOCK at a time each round. SAMPLES: the sampled slots' keys read from
    their copy (samples_ptr [R, NS], contiguous) instead of the row."""
    wait_inputs(PDL)
    r = tl.program_id(0)
    b = r // HKV
    pos = tl.load(positions_ptr + b).to(tl.int32)
    forced_from = tl.load(forced_from_ptr + b).to(tl.int32)
    row = keys_ptr + r.to(tl.int64) * S
    copy = samples_ptr + r.to(tl.int64) * NS
    n_s, target = _sample_target(positions_ptr, tokens_ptr, b, K, MARGIN, STRIDE)
    v = 0  # the search's key so far: its bits above the round's are final
    if RESIDENT:
        j = tl.arange(0, BLOCK)
        s = _jittered(j, STRIDE)
        # (the copy's entries past the row's position hold anything: `_ranked_keys` zeroes them, so its load is
        # masked by the copy's end alone and vectorises)
        stored = tl.load(copy + j, mask=j < NS, other=0) if SAMPLES else tl.load(row + s, mask=s <= pos, other=0)
        key = _ranked_keys(s, _stored_keys(stored, KEY_BITS), pos, forced_from, SINKS, WINDOW, KEY_BITS)
        v = _rank_search(key, v, target, KEY_BITS)
    else:
        for d in tl.static_range(KEY_BITS):
            up = v + (1 << (KEY_BITS - 1 - d))
            shares = tl.zeros([BLOCK], tl.int32)
            for j0 in range(0, n_s, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                s = _jittered(j, STRIDE)
                stored = (tl.load(copy + j, mask=j < NS, other=0) if SAMPLES else
                          tl.load(row + s, mask=s <= pos, other=0))
                shares += _at_least(_ranked_keys(s, _stored_keys(stored, KEY_BITS), pos, forced_from, SINKS, WINDOW,
                                                 KEY_BITS), up)
            v = tl.where(tl.sum(shares, 0) >= target, up, v)
    tl.store(estimate_ptr + r, tl.maximum(v, 1))


@triton.jit
def _compact_kernel(keys_ptr, positions_ptr, forced_from_ptr, estimate_ptr, counts_ptr, stage_ptr, S, SINKS, WINDOW,
                    BPP, CAP, HKV: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """This program's candidates (ranked keys at or above the row's candidate threshold, estimate_ptr[r]): their slots
    compacted in slot order into its own stage (stage_ptr [R, P, CAP] int32: at most CAP kept) and their count
    into counts_ptr[r, p] (`_place_kernel` puts the stages together).

    A block is read as rows of 8 slots (one thread's vector load), each row's candidates folded into the bits of one
    word (a reduction within the thread) and counted; the rows' places follow from the counts (a scan over BLOCK / 8
    rows), and the candidates leave their rows lowest bit first, as many rounds as the fullest row of the block
    holds (two or three at a 2% budget): no scan and no scattered store over every slot."""
    wait_inputs(PDL)
    r = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    b = r // HKV
    pos = tl.load(positions_ptr + b).to(tl.int32)
    forced_from = tl.load(forced_from_ptr + b).to(tl.int32)
    lo = tl.load(estimate_ptr + r)
    ROWS: tl.constexpr = BLOCK // 8
    row = tl.arange(0, ROWS)
    lane = tl.arange(0, 8)[None, :]
    stage = stage_ptr + (r * P + p).to(tl.int64) * CAP
    out = 0
    first = p * BPP * BLOCK
    for i in range(tl.minimum(BPP, tl.maximum(pos - first, -1) // BLOCK + 1)):  # the run's blocks up to the query
        start = first + i * BLOCK
        key = _ranked_at(keys_ptr + r.to(tl.int64) * S, start + row[:, None] * 8 + lane, start, S, pos,
                         forced_from, SINKS, WINDOW, KEY_BITS, BLOCK)  # [ROWS, 8]
        take = key >= lo
        n = tl.sum(take.to(tl.int32), 1)  # [ROWS]
        word = tl.sum(tl.where(take, 1 << lane, 0), 1)  # [ROWS]: disjoint bits, their sum is their OR
        dst = out + tl.cumsum(n, 0) - n  # [ROWS]: where each word's first candidate goes
        for _ in range(tl.max(n, 0)):
            low = word & -word  # the lowest bit left
            bit = (low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # its index: a power of two's exponent
            tl.store(stage + dst, start + row * 8 + bit, mask=(word != 0) & (dst < CAP))
            dst += 1
            word = word & (word - 1)
        out += tl.sum(n, 0)
    tl.store(counts_ptr + r * P + p, out)


@triton.jit
def _place_kernel(keys_ptr, positions_ptr, forced_from_ptr, stage_ptr, counts_ptr, forced_ptr, cand_ptr, slots_ptr,
                  S, C, CAP, SINKS, WINDOW, HKV: tl.constexpr, KEY_BITS: tl.constexpr, PP: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program p's staged slots, with their ranked keys, at the place the earlier programs' counts give them in
    cand_ptr / slots_ptr [R, C] (the row's candidates in slot order), if the row's candidates fit there (at most
    C); its forced keys among them (all forced keys are candidates) counted into forced_ptr[r, p]."""
    wait_inputs(PDL)
    r = tl.program_id(0)
    p = tl.program_id(1)
    P = tl.num_programs(1)
    b = r // HKV
    prog = tl.arange(0, PP)
    above = tl.load(counts_ptr + r * P + prog, mask=prog < P, other=0)
    n_forced = 0
    if tl.sum(above, 0) <= C:  # (then each stage holds all of its program's candidates)
        pos = tl.load(positions_ptr + b).to(tl.int32)
        forced_from = tl.load(forced_from_ptr + b).to(tl.int32)
        out = tl.sum(tl.where(prog < p, above, 0), 0)
        n = tl.sum(tl.where(prog == p, above, 0), 0)
        stage = stage_ptr + (r * P + p).to(tl.int64) * CAP
        for j0 in range(0, n, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            s = tl.load(stage + j, mask=j < n, other=0)
            key = _ranked_keys(s, _stored_keys(tl.load(keys_ptr + r.to(tl.int64) * S + s, mask=j < n, other=0),
                                               KEY_BITS), pos, forced_from, SINKS, WINDOW, KEY_BITS)
            dst = r.to(tl.int64) * C + out + j
            tl.store(cand_ptr + dst, key.to(cand_ptr.dtype.element_ty), mask=j < n)
            tl.store(slots_ptr + dst, s, mask=j < n)
            n_forced += tl.sum(((j < n) & (key == (1 << KEY_BITS) - 1)).to(tl.int32), 0)
    tl.store(forced_ptr + r * P + p, n_forced)


@triton.jit
def _candidate_keys(row_ptr, j, n, C, KEY_BITS: tl.constexpr):
    """Keys j of a candidate row of C, of which n are live (0 past them): the load masked by the row's end, so that
    each thread loads its keys in one vector access."""
    return tl.where(j < n, _stored_keys(tl.load(row_ptr + j, mask=j < C, other=0), KEY_BITS), 0)


@triton.jit
def _candidates_kernel(cand_ptr, slots_ptr, counts_ptr, forced_ptr, positions_ptr, tokens_ptr, estimate_ptr, ok_ptr,
                       idx_ptr, count_ptr, attended_ptr, P, C, K, HKV: tl.constexpr, KEY_BITS: tl.constexpr,
                       PP: tl.constexpr, BLOCK: tl.constexpr, CBLOCK: tl.constexpr, RESIDENT: tl.constexpr,
                       ATTENDED: tl.constexpr, PDL: tl.constexpr):
    """One program a row: whether its candidates (cand_ptr / slots_ptr [R, C] in slot order; the programs' counts
    and forced counts [R, P]) hold its whole selection — at most C of them, and at least as many as it wants or
    every live key (a candidate threshold of 1) — into ok_ptr[r] (a row that is not ok takes the radix path); the
    row's candidate threshold estimate_ptr[r] zeroed for the next select; and for an ok row its selection: the
    threshold key by a rank search over the candidates' keys from the candidate threshold up (a bit a round; the
    keys held in registers, CBLOCK of them, or streamed BLOCK at a time), then every candidate above it and the
    first ones equal to it, in slot order, their slots into idx_ptr [R, K], and count_ptr[r] = wanted."""
    wait_inputs(PDL)
    r = tl.program_id(0)
    b = r // HKV
    prog = tl.arange(0, PP)
    total = tl.sum(tl.load(counts_ptr + r * P + prog, mask=prog < P, other=0), 0)
    n_forced = tl.sum(tl.load(forced_ptr + r * P + prog, mask=prog < P, other=0), 0)
    lo = tl.load(estimate_ptr + r)
    tl.debug_barrier()  # (every thread has read it)
    tl.store(estimate_ptr + r, 0)
    wanted = tl.minimum(tl.maximum(tl.load(tokens_ptr + b).to(tl.int32), n_forced), K)
    ok = (total <= C) & ((total >= wanted) | (lo == 1))  # (a threshold of 1: the candidates are every live key)
    tl.store(ok_ptr + r, ok.to(tl.int32))
    if ok:
        want = tl.minimum(wanted, total)
        if ATTENDED:
            tl.atomic_add(attended_ptr + b, want.to(tl.float32) / HKV)
        row = cand_ptr + r.to(tl.int64) * C
        # every candidate is at or above lo: the threshold lies in [lo, lo + 2^KEY_BITS), searched a bit at a time
        # from the top over the candidates' keys, held in registers where they fit (RESIDENT: C <= CBLOCK)
        wanted_1 = tl.maximum(want, 1)
        threshold = lo
        if RESIDENT:
            held = _candidate_keys(row, tl.arange(0, CBLOCK), total, C, KEY_BITS)
            threshold = _rank_search(held, threshold, wanted_1, KEY_BITS)
            n_above = tl.sum(_at_least(held, threshold + 1), 0)
        else:
            for d in tl.static_range(KEY_BITS):
                up = threshold + (1 << (KEY_BITS - 1 - d))
                shares = tl.zeros([BLOCK], tl.int32)
                for j0 in range(0, total, BLOCK):
                    shares += _at_least(_candidate_keys(row, j0 + tl.arange(0, BLOCK), total, C, KEY_BITS), up)
                threshold = tl.where(tl.sum(shares, 0) >= wanted_1, up, threshold)
            shares = tl.zeros([BLOCK], tl.int32)
            for j0 in range(0, total, BLOCK):
                shares += _at_least(_candidate_keys(row, j0 + tl.arange(0, BLOCK), total, C, KEY_BITS), threshold + 1)
            n_above = tl.sum(shares, 0)  # candidates above the threshold
        k = wanted_1 - n_above  # keys equal to the threshold the row takes
        out = 0  # slots written
        ties = 0  # keys equal to the threshold seen
        for j0 in range(0, total, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            key = _candidate_keys(row, j, total, C, KEY_BITS)
            above = (j < total) & (key > threshold)
            eq = (j < total) & (key == threshold)
            run = tl.cumsum(above.to(tl.int32) + (eq.to(tl.int32) << 16), 0)  # inclusive: above | equal << 16
            eq_upto = run >> 16
            room = tl.maximum(k - ties, 0)  # keys equal to the threshold the row still takes
            take = above | (eq & (eq_upto <= room))
            dst = out + (run & 0xFFFF) + tl.minimum(eq_upto, room) - 1
            slot = tl.load(slots_ptr + r.to(tl.int64) * C + j, mask=take, other=0)
            tl.store(idx_ptr + r.to(tl.int64) * K + dst, slot, mask=take & (dst < want))
            total_run = tl.max(run, 0)
            out += (total_run & 0xFFFF) + tl.minimum(total_run >> 16, room)
            ties += total_run >> 16
        tl.store(count_ptr + r, want)


def key_digits(key_bits: int) -> tuple[int, int]:
    """Radix digits of `key_bits`-bit keys, top first: (how many, bits of the last); every other digit has 8 bits.
    The last digit has at least 5 bits: 8 bits or 13 and more (scorers round their widths up to those)."""
    digits = -(-key_bits // 8)
    last = key_bits - 8 * (digits - 1)
    assert digits == 1 or last >= 5, f"{key_bits}-bit keys: use 8 or 13 bits and more"
    return digits, last


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def programs_per_row(rows: int, blocks: int, device: torch.device, waves: int) -> int:
    """Programs that share one row's blocks: `waves` programs per SM over all rows, never more than blocks."""
    return max(1, min(blocks, -(-waves * _multiprocessors(device) // rows)))


def select_scratch(rows: int, device: torch.device | str) -> torch.Tensor:
    """The counting buffers of `select_topk` over `rows` rows, zeroed: int32 [rows * (4 * 256 + 2)] (the radix
    histograms — keys of up to 16 bits leave half of them, where the candidate path keeps its rows' thresholds —,
    the forced counts, the programs done). Every select leaves them zeroed again, so one scratch serves every layer
    and step of a plan (no memset launch a select)."""
    return torch.zeros(rows * (4 * 256 + 2), dtype=torch.int32, device=device)


def _scratch_views(scratch: torch.Tensor, rows: int, digits: int):
    """-> (hist [rows, digits, 256], stats [rows], done [rows]) views of a `select_scratch`."""
    tail = rows * 4 * 256
    return scratch[:rows * digits * 256].view(rows, digits, 256), scratch[tail:tail + rows], scratch[tail + rows:]


SAMPLE_STRIDE = 16  # the candidate path's threshold is estimated from one slot in 16
SAMPLED_MIN_ROWS = 16  # `sampled=None` takes the candidate path from this many rows (B x Hkv) up: with fewer, its two
# one-program-a-row kernels lose at every length (they grow with the row); bench/select_paths.py, sparse_gpu.md
SAMPLED_MIN_KEYS = 1 << 21  # and from this many keys a select (R x S) up


CANDIDATE_ROOM = 2  # candidates a row has room for, in selection widths (`candidate_width`)


def candidate_width(k: int, capacity: int, room: int = CANDIDATE_ROOM) -> int:
    """Room for one row's candidates on the candidate path: `room` times the width (at least 2: the threshold is
    estimated for 5/4 of the budget) and 256 more, rounded up to a power of two. Ties at the sampled threshold make
    a row overflow it (BinaryPC's keys of qwen2.5-coder-0.5b at 26k tokens: up to 3.6x the wanted keys at stride
    16, 5.9x at stride 32)."""
    return min(capacity, triton.next_power_of_2(room * k + 256))


def takes_candidates(rows: int, capacity: int, k: int, key_bits: int, room: int = CANDIDATE_ROOM) -> bool:
    """Whether `select_topk(sampled=None)` takes the candidate path: keys of up to 16 bits, candidates at most a
    quarter of the row, and enough rows and keys that its extra launches pay (`SAMPLED_MIN_ROWS`, `SAMPLED_MIN_KEYS`;
    measured on an H100 with bench/select_paths.py at 16 shapes from 1 x 32k to 16 x 128k, and a layer's whole step
    with bench attention where the two differ little: below 16 rows the radix path wins at every length, 1.3x at
    1 x 128k and 2x at 1 x 256k; at 1 M keys a select the candidates save ~2 us, which the scorer's copy of the
    sampled keys costs back)."""
    return (key_bits <= 16 and 4 * candidate_width(k, capacity, room) <= capacity and rows >= SAMPLED_MIN_ROWS
            and rows * capacity >= SAMPLED_MIN_KEYS)


def _radix(keys, positions, tokens, forced_from, k, key_bits, sinks, window, idx, count, attended, hist, stats, done,
           block, waves, num_warps, skip=None):
    """The radix passes and the write pass over keys [R, S] (rows whose skip[r] is set left alone)."""
    R, S = keys.shape
    hkv, digits, last = R // positions.shape[0], *key_digits(key_bits)
    block = min(block, triton.next_power_of_2(S))
    nb = triton.cdiv(S, block)
    P = programs_per_row(R, nb, keys.device, waves)
    bpp = triton.cdiv(nb, P)
    part = torch.empty(R, P, (1 << last) + 1, dtype=torch.int32, device=keys.device)
    launch = chained(keys.device)
    common = (keys, positions, tokens, forced_from, hist, stats, part, keys if skip is None else skip)
    for d in range(digits):
        _histogram_kernel[(R, P)](*common, S, k, sinks, window, bpp, HKV=hkv, KEY_BITS=key_bits, LAST=last, D=d,
                                  P=P, BLOCK=block, SKIP=skip is not None, num_warps=num_warps, **launch)
    _write_kernel[(R, P)](*common, idx, count, count if attended is None else attended, done, S, k, sinks, window,
                          bpp, HKV=hkv, KEY_BITS=key_bits, LAST=last, P=P, PP=triton.next_power_of_2(P), BLOCK=block,
                          ATTENDED=attended is not None, SKIP=skip is not None, num_warps=num_warps,
                          **launch)


def forced_block(width: int) -> int:
    """Slots of a forced list of `width` that `_force_listed` takes a step."""
    return min(256, triton.next_power_of_2(max(width, 1)))


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _launch_sample(keys, samples, positions, tokens, forced_from, out, k, key_bits, sinks, window, stride, margin,
                   resident_keys, launch):
    """`_sample_kernel` over keys [R, S] (the sampled slots' keys from `samples` where given) into out [R] int32."""
    R, S = keys.shape
    n_s = triton.cdiv(S, stride)
    sblock = min(resident_keys, triton.next_power_of_2(n_s))
    _sample_kernel[(R,)](keys, keys if samples is None else samples, positions, tokens, forced_from, out, S, n_s, k,
                         sinks, window, margin, HKV=R // positions.shape[0], KEY_BITS=key_bits, STRIDE=stride,
                         BLOCK=sblock, RESIDENT=n_s <= sblock, SAMPLES=samples is not None,
                         num_warps=max(4, min(8, sblock // 512)), **launch)


def candidate_thresholds(keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, forced_from: torch.Tensor,
                         k: int, key_bits: int, sinks: int = 0, window: int = 0, stride: int = SAMPLE_STRIDE,
                         margin: int = 16, samples: torch.Tensor | None = None,
                         resident_keys: int = 8192) -> torch.Tensor:
    """The candidate path's threshold of each row (`select_topk(sampled=True)` with the same arguments selects among
    its keys at or above it) -> int32 [R]: the largest key that the sample's target rank of its sampled keys reach
    (`candidate_thresholds_ref`), or 1 where fewer are live. keys [R, S] (up to 16 bits), positions / tokens /
    forced_from [B], `samples` and `resident_keys` as `select_topk` takes them; the forced list is not applied."""
    assert keys.dtype == torch.int16 and keys.is_contiguous() and key_bits <= 16 and _pow2(stride)
    out = torch.empty(keys.shape[0], dtype=torch.int32, device=keys.device)
    _launch_sample(keys, samples, positions, tokens, forced_from, out, k, key_bits, sinks, max(window, 1), stride,
                   margin, resident_keys, chained(keys.device))
    return out


def candidate_thresholds_ref(keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                             forced_from: torch.Tensor, k: int, key_bits: int, sinks: int = 0, window: int = 0,
                             stride: int = SAMPLE_STRIDE, margin: int = 16) -> torch.Tensor:
    """The torch reference of `candidate_thresholds`: per row, the sampled slots up to the query (`sampled_slots`)
    with the select's ranked keys (forced slots at the maximal key), the target rank — 5/4 of the budget's share of
    the sample plus `margin`, at least 1 — and the key at that rank from the top (1 where fewer are live)."""
    R, S = keys.shape
    hkv, top = R // positions.shape[0], (1 << key_bits) - 1
    slots = sampled_slots(S, stride, keys.device)
    out = torch.ones(R, dtype=torch.int32)
    for r in range(R):
        b = r // hkv
        pos = int(positions[b])
        n = pos + 1
        n_s = -(-n // stride)
        want = min(int(tokens[b]), k)
        target = max((want * 5 * n_s + 4 * n - 1) // (4 * n) + margin, 1)
        s = slots[:n_s]
        key = keys[r, s.clamp_max(S - 1)].long() & top
        forced = (s < sinks) | (s > pos - max(window, 1)) | (s >= int(forced_from[b]))
        key = torch.where(s <= pos, torch.where(forced, top, key), 0)
        ranked = key[key > 0].sort(descending=True).values
        if len(ranked) >= target:
            out[r] = int(ranked[target - 1])
    return out.to(keys.device)


def select_topk(keys: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, forced_from: torch.Tensor,
                k: int, key_bits: int, sinks: int = 0, window: int = 0, extra: torch.Tensor | None = None,
                extra_n: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                attended: torch.Tensor | None = None, scratch: torch.Tensor | None = None, block: int = 2048,
                waves: int = 4, num_warps: int = 8, sampled: bool | None = None, stride: int = SAMPLE_STRIDE,
                margin: int = 16, room: int = CANDIDATE_ROOM, scan_waves: int = 4, scan_block: int = 2048,
                pick_block: int = 2048, served: torch.Tensor | None = None, samples: torch.Tensor | None = None,
                resident_keys: int = 8192):
    """keys [R, S] int16/int32 (the forced list is written into it), positions / tokens / forced_from [B] int32
    or int64, extra [R, E] int32 with extra_n [B] -> (idx [R, k] int32, count [R] int32). `key_bits` is 16 or 32
    (int16 keys: 16). `attended` [B] fp32: each row's mean count over its KV heads is added to it. `scratch`: a
    `select_scratch` for R rows (default: a fresh one). Tuning: `block` slots per step of a program (a power of
    two), `waves` programs per SM, `num_warps` per program. Shapes alone fix the launches: capturable in a CUDA
    graph.

    `sampled` (keys of up to 16 bits; None: `takes_candidates`): the candidate path. A threshold estimated from
    one slot in `stride` (`margin` sample ranks of slack) splits off each row's candidates — one compaction
    pass and a placing pass over the candidates, no histogram over the whole row — and one program a row selects
    among the candidates alone (room for `candidate_width(k, S, room)` of them a row).
    A row whose candidates do not hold its whole selection (too few above the threshold, or more than fit) takes the
    radix path over all its keys in the same launches; the selection is the same either way. Its compaction pass takes
    `scan_block` slots a step and `scan_waves` programs per SM, the candidates' program `pick_block` candidates a
    step with a warp per 256 of them; the sample's and the candidates' programs (one a row each) hold a row's
    sample or candidates in registers where they number at most `resident_keys` (else they stream them).
    `served` int32 [R], if given, is set to
    1 for the rows the candidates served and 0 for the others (every row 0 on the radix path): the selection never
    shows it, the time does. `samples` [R, ceil(S / stride)], keys' dtype, if given: the keys of the sampled slots
    (`sampled_slots(S, stride)`), as a scorer wrote them beside the keys (`score_keys(samples=)`): the sample's pass
    reads this contiguous copy instead of one key in every `stride` slots of each row (at stride 16, every 32-byte
    sector of 2-byte keys); the forced list is written into both, so the selection and the rows served are the
    same."""
    R, S = keys.shape
    assert (keys.dtype == torch.int16 and 8 <= key_bits <= 16) or (keys.dtype == torch.int32 and key_bits == 32)
    assert keys.is_contiguous(), "keys [R, S] must be contiguous: the passes step through a row S slots apart"
    assert served is None or (served.shape == (R,) and served.dtype == torch.int32 and served.device == keys.device)
    n_s = triton.cdiv(S, max(stride, 1))
    assert samples is None or (samples.shape == (R, n_s) and samples.dtype == keys.dtype and samples.is_contiguous()
                               and samples.device == keys.device), "samples: [R, ceil(S / stride)] of the keys' dtype"
    B = positions.shape[0]
    hkv, digits = R // B, key_digits(key_bits)[0]
    idx, count = out if out is not None else (torch.empty(R, k, dtype=torch.int32, device=keys.device),
                                              torch.empty(R, dtype=torch.int32, device=keys.device))
    scratch_all = select_scratch(R, keys.device) if scratch is None else scratch
    launch = chained(keys.device)
    hist, stats, done = _scratch_views(scratch_all, R, digits)
    if extra is not None and extra.shape[1] > 0:
        E = extra.shape[1]
        _force_kernel[(R,)](keys, keys if samples is None else samples, positions, extra, extra_n, S, n_s, E,
                            HKV=hkv, EBLOCK=forced_block(E), STRIDE=max(stride, 1),
                            SAMPLES=samples is not None, num_warps=4, **launch)
    window = max(window, 1)
    tuning = dict(block=block, waves=waves, num_warps=num_warps)
    if sampled is None:
        sampled = takes_candidates(R, S, k, key_bits, room)
    if not (_pow2(block) and block <= 1 << 14 and _pow2(pick_block) and pick_block <= 1 << 14 and _pow2(scan_block)
            and scan_block >= 8 and _pow2(resident_keys)):
        # (the writes pack two running counts of a block into one int32: 15 bits each; the compaction reads rows of 8)
        raise ValueError(f"block and pick_block take powers of two up to 16384, scan_block one of at least 8 and "
                         f"resident_keys any power of two, got {block}, {pick_block}, {scan_block} and "
                         f"{resident_keys}")
    if not sampled:
        _radix(keys, positions, tokens, forced_from, k, key_bits, sinks, window, idx, count, attended, hist, stats,
               done, **tuning)
        if served is not None:
            served.zero_()
        return idx, count
    if key_bits > 16 or not _pow2(stride) or room < 2:
        raise ValueError(f"the candidate path takes keys of up to 16 bits, a power-of-two stride and room for at "
                         f"least twice the width, got {key_bits} bits, stride {stride}, room {room}")
    C = candidate_width(k, S, room)
    estimate = scratch_all[R * 2 * 256:R * 2 * 256 + R]  # [R]: the radix digits of <= 16-bit keys leave it
    _launch_sample(keys, samples, positions, tokens, forced_from, estimate, k, key_bits, sinks, window, stride, margin,
                   resident_keys, launch)
    blk = min(scan_block, max(32, triton.next_power_of_2(S)))
    nb = triton.cdiv(S, blk)
    P = programs_per_row(R, nb, keys.device, scan_waves)
    bpp = triton.cdiv(nb, P)
    cap = min(C, bpp * blk)  # a program's stage: more than C candidates leave the row to the radix path anyway
    counts = torch.empty(R, P, dtype=torch.int32, device=keys.device)  # each program's candidates
    n_forced = torch.empty(R, P, dtype=torch.int32, device=keys.device)  # and forced keys among them
    stage = torch.empty(R, P, cap, dtype=torch.int32, device=keys.device)
    _compact_kernel[(R, P)](keys, positions, forced_from, estimate, counts, stage, S, sinks, window, bpp, cap,
                            HKV=hkv, KEY_BITS=key_bits, BLOCK=blk,
                            num_warps=num_warps, **launch)
    cand = torch.empty(R, C, dtype=keys.dtype, device=keys.device)
    slots = torch.empty(R, C, dtype=torch.int32, device=keys.device)
    _place_kernel[(R, P)](keys, positions, forced_from, stage, counts, n_forced, cand, slots, S, C, cap, sinks, window,
                          HKV=hkv, KEY_BITS=key_bits, PP=triton.next_power_of_2(P), BLOCK=1024, num_warps=4,
                          **launch)
    ok = torch.empty(R, dtype=torch.int32, device=keys.device)
    pick = min(pick_block, triton.next_power_of_2(C))  # the candidates' program's block: a warp per 256
    _candidates_kernel[(R,)](cand, slots, counts, n_forced, positions, tokens, estimate, ok, idx, count,
                             count if attended is None else attended, P, C, k, HKV=hkv, KEY_BITS=key_bits,
                             PP=triton.next_power_of_2(P), BLOCK=pick,
                             CBLOCK=min(triton.next_power_of_2(C), resident_keys), RESIDENT=C <= resident_keys,
                             ATTENDED=attended is not None,
                             num_warps=max(1, min(16, pick // 256)), **launch)
    if served is not None:
        served.copy_(ok)
    _radix(keys, positions, tokens, forced_from, k, key_bits, sinks, window, idx, count, attended, hist, stats, done,
           skip=ok, **tuning)
    return idx, count


def sampled_slots(capacity: int, stride: int = SAMPLE_STRIDE, device: torch.device | str = "cpu") -> torch.Tensor:
    """The slots the candidate path samples in a row of `capacity` slots, one in each run of `stride` (`_jittered`)
    -> int64 [ceil(capacity / stride)] (the last may lie past the capacity: never live, never read)."""
    j = torch.arange(-(-capacity // stride), device=device)
    hashed = (j * -1640531535) & 0xFFFFFFFF  # the kernels' int32 product, as 32 unsigned bits
    return j * stride + ((hashed >> 16) & (stride - 1))


def same_selection(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether two selections (idx [R, W], count [R]) hold the same slots in every row (columns past a row's count
    are garbage and not compared)."""
    (ia, ca), (ib, cb) = a, b
    live = torch.arange(ia.shape[1], device=ia.device) < ca[:, None]
    return torch.equal(ca, cb) and torch.equal(torch.where(live, ia, -1), torch.where(live, ib, -1))


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


@triton.jit
def _expand_kernel(pages_ptr, page_count_ptr, positions_ptr, idx_ptr, count_ptr, attended_ptr, KP, W,
                   HKV: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr, ATTENDED: tl.constexpr,
                   PDL: tl.constexpr):
    wait_inputs(PDL)
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    b = r // HKV
    pos = tl.load(positions_ptr + b).to(tl.int32)
    n = tl.minimum(tl.load(page_count_ptr + r) * PAGE - (PAGE - 1 - pos % PAGE), W)
    first = tl.load(pages_ptr + r.to(tl.int64) * KP + j // PAGE, mask=j < n, other=0)
    tl.store(idx_ptr + r.to(tl.int64) * W + j, first * PAGE + j % PAGE, mask=j < n)
    if tl.program_id(1) == 0:
        tl.store(count_ptr + r, n)
        if ATTENDED:
            tl.atomic_add(attended_ptr + b, n.to(tl.float32) / HKV)


def expand_pages(pages: torch.Tensor, page_count: torch.Tensor, positions: torch.Tensor, page: int,
                 out: tuple[torch.Tensor, torch.Tensor], attended: torch.Tensor | None = None, block: int = 1024):
    """A page selection -> its slots. pages [R, KP] int32 (in page order, the query's own page last, as
    `select_topk` over page keys leaves it), page_count [R] int32, positions [B] -> out = (idx [R, W] int32 in
    slot order, count [R] int32): every slot of the selected pages up to the query's. `attended` [B] fp32: each
    row's mean count over its KV heads is added to it. Capturable in a CUDA graph."""
    R, KP = pages.shape
    idx, count = out
    W = idx.shape[1]
    block = min(block, triton.next_power_of_2(W))
    _expand_kernel[(R, triton.cdiv(W, block))](pages, page_count, positions, idx, count,
                                               count if attended is None else attended, KP, W, HKV=R // len(positions),
                                               PAGE=page, BLOCK=block, ATTENDED=attended is not None, num_warps=4,
                                               **chained(pages.device))
    return idx, count


def expand_pages_ref(pages: torch.Tensor, page_count: torch.Tensor, positions: torch.Tensor, page: int,
                     width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `expand_pages` -> (idx [R, width] int32, zeros past count; count [R] int32)."""
    R, KP = pages.shape
    pos = positions.long().repeat_interleave(R // len(positions))[:, None]  # [R, 1]
    n = (page_count.long()[:, None] * page - (page - 1 - pos % page)).clamp_max(width)  # [R, 1]
    j = torch.arange(width, device=pages.device)
    first = pages.long().gather(1, (j // page).clamp_max(KP - 1).expand(R, -1))
    return torch.where(j < n, first * page + j % page, 0).int(), n.squeeze(-1).int()


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores [..., S] -> int32 keys for `select_topk(key_bits=32)` in the same order: -inf (never attend)
    -> 0, +inf (forced) -> the maximum key, everything else in IEEE order in between."""
    bits = (scores.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 becomes 0.0, a tie as in a sort
    unsigned = torch.where(bits >= 0, bits | (1 << 31), ~bits & 0xFFFFFFFF)  # IEEE order as unsigned integers
    unsigned = torch.where(scores == float("-inf"), 0, torch.where(scores == float("inf"), 0xFFFFFFFF, unsigned))
    return (unsigned - ((unsigned >> 31) << 32)).int()  # the same 32 bits as a signed int32
