"""BinaryPC kernels: the quantised probe turned into byte lookup tables, table scoring with the group max fused in,
and the residual sign encoding of keys. Each has its torch reference (`*_ref`), which is also the CPU path.

    probe   q [B, Hq, D], basis [B, Hkv, b, D] fp32 -> probe [B*Hkv, G, b] int32 (p̃, the quantised probe) and
            tables [B*Hkv, T, NB, 256] int64 (NB = ceil(b / 8) code bytes; T tables of `lanes` query heads each)
    score   codes [B, Hkv, S, W] int64, tables, positions [B] -> keys [B*Hkv, S] int16/int32
            key = max over the group of Σ_i p̃_i h_i, plus an offset that makes every key >= 1 (0 = never attend);
            optionally a forced list (extra=) written as maximal keys, the select's `extra` done in the same pass
    packed  q, basis -> probe [B*Hkv, G, b] int32, packed [B*Hkv, G, H, 8] int32 (H = 2 ceil(b / 64) code halves:
            the probe's signed bytes four to a word, `packed_probe`), sums [B*Hkv, G] int32 (Σ_i p̃_i)
    score   codes, packed, sums, positions -> keys as above, by dp4a (`score_keys_dp4a`)
    encode  keys [B, Hkv, S, D], basis -> codes [B, Hkv, S, W] int64 and reconstruction error [B, Hkv, S] fp32
            of the slots [start[b], end[b]) of each row

Scoring by tables: with h_i = +1 where code bit i is set and −1 where not, Σ_i p̃_i h_i is a sum over the code's
bytes of Σ_{t<8} p̃_{8j+t} h_{8j+t}, which depends only on byte j's value. So the probe kernel tabulates, per byte
position j and byte value c, that partial sum for every query head once per step, and the score kernel adds NB
table entries per key instead of counting bits plane by plane (one table read per byte instead of m popcounts per
word and query head). Several query heads share one int64 entry as lanes of 16 (or 32) bits, each entry biased by
8 (2^m − 1) so a lane never goes negative and a sum of NB entries never carries into the next lane: one read
serves up to four query heads. The reference is the policy's own popcount scoring (`packed_scores`), a different
computation of the same integers.

Scoring by dp4a (`probe_packed`, `score_keys_dp4a`; 7 magnitude bits at most): with b_i the code's bits (0 or 1),
Σ_i p̃_i h_i = 2 Σ_i p̃_i b_i − Σ_i p̃_i. For a 32-bit half of the code, (half >> k) & 0x01010101 holds bits k, k + 8,
k + 16, k + 24 as the bytes 0 or 1, so one `dp4a` (four byte products, summed) against those four bits' p̃, packed
as signed bytes, adds their part of Σ p̃_i b_i: 16 dp4a a 64-bit code and query head, all in registers — no table
in shared memory (the table scorer's bound: its lookups' bank conflicts and the tables' 16 KB a program).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import chained, wait_inputs

from ..attention.binarypc import encode, pack_bits, packed_scores, quantize_probe
from .select import SAMPLE_STRIDE, _force_listed, _jittered, forced_block, sampled_slots


def key_range(bits: int, magnitude_bits: int) -> tuple[int, int]:
    """(offset that makes the lowest score 1, key bits for `select_topk`: the fewest that hold every score below
    the all-ones forced key, 8 or at least 13 (its digits' rule), stored as int16 up to 15 bits, else as int32 keys
    of 32 bits). Fewer key bits, cheaper selection: 7-bit probes of 64-bit codes take 14 (digits of 8 and 6 bits)."""
    offset = ((1 << magnitude_bits) - 1) * bits + 1
    need = (2 * offset).bit_length()  # scores lie in [1, 2 * offset - 1] < 2^need - 1
    return offset, 8 if need <= 8 else max(13, need) if need <= 15 else 32


def key_dtype(key_bits: int) -> torch.dtype:
    return torch.int16 if key_bits <= 16 else torch.int32


@dataclass(frozen=True)
class TableLayout:
    """How a group's byte tables are packed: NB byte positions, `lanes` query heads of `lane_bits` per int64
    entry, `tables` entries per (byte position, value), each lane biased by `bias`."""
    nb: int
    lanes: int
    lane_bits: int
    tables: int
    bias: int

    @classmethod
    def of(cls, group: int, bits: int, magnitude_bits: int) -> "TableLayout":
        nb = -(-bits // 8)
        bias = 8 * ((1 << magnitude_bits) - 1)
        # a lane holds a sum of nb biased entries, each in [0, 2 * bias]
        lane_bits = 16 if nb * 2 * bias < (1 << 16) else 32
        assert nb * 2 * bias < (1 << lane_bits), "probe too wide for 32-bit lanes"
        lanes = 64 // lane_bits
        return cls(nb, lanes, lane_bits, -(-group // lanes), bias)


def byte_tables(probe: torch.Tensor, magnitude_bits: int) -> torch.Tensor:
    """The torch reference of the tables: probe [R, G, b] integers -> tables [R, T, NB, 256] int64 (layout
    `TableLayout.of(G, b, m)`)."""
    R, G, bits = probe.shape
    lay = TableLayout.of(G, bits, magnitude_bits)
    p = torch.zeros(R, lay.tables * lay.lanes, lay.nb * 8, dtype=torch.int64, device=probe.device)
    p[:, :G, :bits] = probe.long()
    c = torch.arange(256, device=probe.device)
    sign = ((c[:, None] >> torch.arange(8, device=probe.device)) & 1) * 2 - 1  # [256, 8]: h of each bit
    partial = (p.view(R, lay.tables, lay.lanes, lay.nb, 1, 8) * sign).sum(-1) + lay.bias  # [R, T, lanes, NB, 256]
    live = (torch.arange(lay.tables * lay.lanes, device=probe.device) < G).view(1, lay.tables, lay.lanes, 1, 1)
    shifts = (torch.arange(lay.lanes, device=probe.device) * lay.lane_bits).view(1, 1, lay.lanes, 1, 1)
    return (torch.where(live, partial, 0) << shifts).sum(2)  # disjoint lanes: the sum is their OR


# ---------------------------------------------------------------------------------------------- probe

@triton.jit
def _round_half_even(x):
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


@triton.jit
def _probe_kernel(q_ptr, basis_ptr, probe_ptr, tables_ptr, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  W: tl.constexpr, M: tl.constexpr, NB: tl.constexpr, LANES: tl.constexpr,
                  LANE_BITS: tl.constexpr, T: tl.constexpr, BIAS: tl.constexpr, BYTES: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    r = tl.program_id(0)  # (row, KV head); its query heads are r * G .. r * G + G - 1
    i = tl.arange(0, 64)
    d = tl.arange(0, D)
    top = (1 << M) - 1
    scale = 0.0
    for w in tl.static_range(W):  # the scale: max |probe| over the group and every bit
        basis = tl.load(basis_ptr + (r * BITS + w * 64 + i)[:, None] * D + d[None, :],
                        mask=(w * 64 + i < BITS)[:, None], other=0.0)  # [64, D]
        for g in tl.static_range(G):
            qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)
            scale = tl.maximum(scale, tl.max(tl.abs(tl.sum(basis * qg[None, :], 1)), 0))
    scale = tl.maximum(scale, 1e-30)
    t = tl.arange(0, 8)
    c = tl.arange(0, 256)
    sign = tl.where(((c[:, None] >> t[None, :]) & 1) == 1, 1, -1)  # [256, 8]: h of each bit of byte value c
    for jj in tl.static_range(BYTES):  # the code bytes j whose bits 8j .. 8j + 7 this program quantises, tabulates
        j = tl.program_id(1) * BYTES + jj
        bit = j * 8 + t
        live = bit < BITS
        basis = tl.load(basis_ptr + (r * BITS + bit)[:, None] * D + d[None, :], mask=live[:, None],
                        other=0.0)  # [8, D]
        for tb in tl.static_range(T):
            entry = tl.zeros([256], dtype=tl.int64)
            for lane in tl.static_range(LANES):
                if tb * LANES + lane < G:
                    g = tb * LANES + lane
                    qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)
                    p = _round_half_even(tl.math.div_rn(tl.sum(basis * qg[None, :], 1), scale) * top).to(tl.int32)
                    tl.store(probe_ptr + (r * G + g) * BITS + bit, p, mask=live)
                    part = tl.sum(sign * tl.where(live, p, 0)[None, :], 1) + BIAS  # [256]
                    entry += part.to(tl.int64) << (lane * LANE_BITS)
            tl.store(tables_ptr + ((r * T + tb) * NB + j) * 256 + c, entry, mask=j * 256 + c < NB * 256)


def probe_bytes(rows: int, nb: int) -> int:
    """Code bytes a program of the probe tabulates, for `rows` (row, KV head) pairs of NB bytes each: every program
    first computes its row's scale (all b projections of the group), so once there are programs enough to fill the
    device, longer ones pay it fewer times; a whole row in one program is too long. The largest power of two that
    leaves ~512 programs, at most NB / 2 (H200, 8 KV heads, 64-bit codes, us: 1 x 8 rows 5.9 at one byte a
    program, 22.2 at eight; 16 x 8 rows 18.8 at one, 14.7 at two; 32 x 8 rows 34.8 / 26.6 / 22.5 at one / two /
    four, `sparse-gpu/nineteenth/probe_sweep.json`)."""
    per = 1
    while per * 2 <= min(nb // 2, rows * nb // 512):
        per *= 2
    return per


def probe_tables(q: torch.Tensor, basis: torch.Tensor, magnitude_bits: int, bytes_per_program: int | None = None):
    """q [B, Hq, D] (any float dtype), basis [B, Hkv, b, D] fp32 -> (probe [B*Hkv, G, b] int32,
    tables [B*Hkv, T, NB, 256] int64). `bytes_per_program`: default `probe_bytes`."""
    B, Hq, D = q.shape
    _, Hkv, bits, _ = basis.shape
    G, W, R = Hq // Hkv, -(-bits // 64), B * Hkv
    lay = TableLayout.of(G, bits, magnitude_bits)
    per = bytes_per_program or probe_bytes(R, lay.nb)
    probe = torch.empty(R, G, bits, dtype=torch.int32, device=q.device)
    tables = torch.empty(R, lay.tables, lay.nb, 256, dtype=torch.int64, device=q.device)
    _probe_kernel[(R, triton.cdiv(lay.nb, per))](
        q.contiguous(), basis.contiguous(), probe, tables, G=G, D=D, BITS=bits, W=W, M=magnitude_bits, NB=lay.nb,
        LANES=lay.lanes, LANE_BITS=lay.lane_bits, T=lay.tables, BIAS=lay.bias, BYTES=per, num_warps=4,
        **chained(q.device))
    return probe, tables


def probe_tables_ref(q: torch.Tensor, basis: torch.Tensor, magnitude_bits: int):
    """The torch reference of `probe_tables`."""
    B, Hq, D = q.shape
    _, Hkv, bits, _ = basis.shape
    probe = q.view(B, Hkv, Hq // Hkv, D).float() @ basis.transpose(-1, -2)  # [B, Hkv, G, b]
    p = quantize_probe(probe, magnitude_bits).flatten(0, 1)  # [R, G, b]
    return p.int(), byte_tables(p, magnitude_bits)


# ---------------------------------------------------------------------------------------------- scoring

@triton.jit
def _store_keys(keys_ptr, samples_ptr, extra_ptr, extra_n_ptr, r, start, key, pos, S, NS, E, HKV: tl.constexpr,
                BLOCK: tl.constexpr, STRIDE: tl.constexpr, SAMPLES: tl.constexpr, EXTRA: tl.constexpr,
                EBLOCK: tl.constexpr):
    """A block's keys (slots start .. start + BLOCK - 1, start a multiple of BLOCK) into the row up to the query's
    position, and with SAMPLES the sampled slots' among them (`select.sampled_slots`: one in each run of STRIDE)
    into their contiguous copy samples_ptr [R, NS], for the select's sample pass. With EXTRA, then the slots of
    the row's forced list (extra_ptr [R, E], its first extra_n_ptr[b]) in the block at the maximal key, as
    `select_topk(extra=)` would write them (no launch of its own for the select)."""
    s = start + tl.arange(0, BLOCK)
    key = key.to(keys_ptr.dtype.element_ty)
    tl.store(keys_ptr + r.to(tl.int64) * S + s, key, mask=s <= pos)
    if SAMPLES:
        j = start // STRIDE + tl.arange(0, BLOCK // STRIDE)  # the block's runs
        at = _jittered(j, STRIDE) - j * STRIDE  # each run's sampled slot
        runs = tl.reshape(key, (BLOCK // STRIDE, STRIDE))
        picked = tl.sum(tl.where(tl.arange(0, STRIDE)[None, :] == at[:, None], runs, 0), 1)
        tl.store(samples_ptr + r.to(tl.int64) * NS + j, picked.to(samples_ptr.dtype.element_ty),
                 mask=j * STRIDE + at <= pos)
    if EXTRA:
        tl.debug_barrier()  # (the block's own keys stored first, by all its threads: the listed ones then overwrite)
        _force_listed(keys_ptr, samples_ptr, extra_ptr, r, tl.load(extra_n_ptr + r // HKV), pos, start,
                      start + BLOCK, S, NS, E, EBLOCK, STRIDE, SAMPLES)


@triton.jit
def _score_kernel(codes_ptr, tables_ptr, positions_ptr, keys_ptr, samples_ptr, extra_ptr, extra_n_ptr, S, NS, E,
                  OFFSET, HKV: tl.constexpr, G: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, NB: tl.constexpr,
                  LANES: tl.constexpr, LANE_BITS: tl.constexpr, T: tl.constexpr, BIAS: tl.constexpr,
                  BLOCK: tl.constexpr, STRIDE: tl.constexpr, SAMPLES: tl.constexpr, EXTRA: tl.constexpr,
                  EBLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(positions_ptr + r // HKV)
    live = s <= pos
    w = tl.arange(0, WP)
    tile = tl.load(codes_ptr + (r.to(tl.int64) * S + s[:, None]) * W + w[None, :],
                   mask=live[:, None] & (w[None, :] < W), other=0)  # [BLOCK, WP]
    LANE_MASK: tl.constexpr = (1 << LANE_BITS) - 1
    best = tl.full([BLOCK], -(1 << 40), tl.int64)
    for tb in tl.static_range(T):
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        table = tables_ptr + (r * T + tb) * NB * 256
        for k in tl.static_range(W):
            word = tl.sum(tl.where(w[None, :] == k, tile, 0), 1)  # [BLOCK]
            for byte in tl.static_range(8):
                if k * 8 + byte < NB:
                    # the byte's table held by the program and read through shared memory (a gather through L1
                    # touches ~16 cache lines a warp: 1.5x slower on the H200)
                    table_j = tl.load(table + (k * 8 + byte) * 256 + tl.arange(0, 256))
                    acc += tl.gather(table_j, ((word >> (8 * byte)) & 255).to(tl.int32), 0)
        for lane in tl.static_range(LANES):
            if tb * LANES + lane < G:
                best = tl.maximum(best, (acc >> (lane * LANE_BITS)) & LANE_MASK)
    _store_keys(keys_ptr, samples_ptr, extra_ptr, extra_n_ptr, r, tl.program_id(1) * BLOCK, best - NB * BIAS + OFFSET,
                pos, S, NS, E, HKV, BLOCK, STRIDE, SAMPLES, EXTRA, EBLOCK)


def score_keys(codes: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor, magnitude_bits: int, bits: int,
               group: int, out: torch.Tensor | None = None, block: int = 1024, num_warps: int = 4,
               samples: torch.Tensor | None = None,
               extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """codes [B, Hkv, S, W] int64, tables from `probe_tables` (`group` query heads per KV head), positions [B]
    -> keys [B*Hkv, S] (int16 or int32 by `key_range`; slots past a row's position are not written). `samples`
    [B*Hkv, ceil(S / SAMPLE_STRIDE)] of the keys' dtype, if given: the keys of `select.sampled_slots` written there
    too (for `select_topk(samples=)`). `extra` (slots [B*Hkv, E] int32, counts [B] int32), if given: each row's
    first counts[b] listed slots written as maximal keys (in the copy too), the forced list of `select_topk(extra=)`
    (which then needs none). Tuning: `block` slots and `num_warps` a program."""
    B, Hkv, S, W = codes.shape
    lay = TableLayout.of(group, bits, magnitude_bits)
    offset, key_bits = key_range(bits, magnitude_bits)
    out = _keys_out(out, samples, B * Hkv, S, key_bits, codes.device)
    block = _block(block, S, samples)
    slots, counts, E, eblock = _forced_list(extra, out, B)
    _score_kernel[(B * Hkv, triton.cdiv(S, block))](
        codes, tables, positions, out, out if samples is None else samples, slots, counts, S,
        triton.cdiv(S, SAMPLE_STRIDE), E, offset, HKV=Hkv, G=group, W=W, WP=triton.next_power_of_2(W), NB=lay.nb,
        LANES=lay.lanes, LANE_BITS=lay.lane_bits, T=lay.tables, BIAS=lay.bias, BLOCK=block, STRIDE=SAMPLE_STRIDE,
        SAMPLES=samples is not None, EXTRA=extra is not None, EBLOCK=eblock, num_warps=num_warps,
        **chained(codes.device))
    return out


def sample_copy(rows: int, capacity: int, key_bits: int, device: torch.device | str) -> torch.Tensor:
    """A buffer for the scorers' copy of the sampled slots' keys (`samples=`): [rows, ceil(capacity /
    SAMPLE_STRIDE)] of the keys' dtype, uninitialised (the scorers write its live entries)."""
    return torch.empty(rows, triton.cdiv(capacity, SAMPLE_STRIDE), dtype=key_dtype(key_bits), device=device)


def _keys_out(out: torch.Tensor | None, samples: torch.Tensor | None, rows: int, S: int, key_bits: int, device):
    """A scorer's keys buffer (`out`, or a new one), its `samples` checked against it (`sample_copy`'s shape)."""
    if out is None:
        out = torch.empty(rows, S, dtype=key_dtype(key_bits), device=device)
    assert samples is None or (samples.shape == (rows, triton.cdiv(S, SAMPLE_STRIDE)) and samples.dtype == out.dtype
                               and samples.is_contiguous()), "samples: a `sample_copy` of the keys' rows and capacity"
    return out


def _block(block: int, S: int, samples: torch.Tensor | None) -> int:
    """A scorer's slots a program: at most the row's (rounded up to a power of two), and whole runs of the sample's
    stride where it copies the sampled slots."""
    block = min(block, triton.next_power_of_2(S))
    return block if samples is None else max(block, SAMPLE_STRIDE)


def _forced_list(extra: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor, batch: int):
    """A scorer's forced list (slots [R, E] int32, counts [B] int32), checked -> (slots, counts, E, the block its
    loop takes); none: the keys' pointer twice (never read), width 0."""
    if extra is None:
        return out, out, 0, 1
    slots, counts = extra
    assert (slots.dtype == counts.dtype == torch.int32 and slots.shape[0] == out.shape[0] and slots.is_contiguous()
            and counts.shape == (batch,)), "extra: slots [B*Hkv, E] int32 (contiguous), counts [B] int32"
    return slots, counts, slots.shape[1], forced_block(slots.shape[1])


def sampled_keys_ref(keys: torch.Tensor) -> torch.Tensor:
    """keys [R, S] -> the keys of `select.sampled_slots(S)` [R, ceil(S / SAMPLE_STRIDE)] (a slot past S: 0), what
    the scorers write into `samples`."""
    slots = sampled_slots(keys.shape[1], SAMPLE_STRIDE, keys.device)
    inside = slots < keys.shape[1]
    return torch.where(inside, keys[:, slots.clamp_max(keys.shape[1] - 1)], 0)


def score_keys_ref(codes: torch.Tensor, probe: torch.Tensor, positions: torch.Tensor, magnitude_bits: int,
                   bits: int) -> torch.Tensor:
    """The torch reference of `score_keys` from the probe [B*Hkv, G, b] itself, by the policy's popcount scoring
    (every slot scored, slots past the position left at 0)."""
    B, Hkv, S, W = codes.shape
    offset, key_bits = key_range(bits, magnitude_bits)
    keys = packed_scores(codes, probe.long().view(B, Hkv, -1, bits), magnitude_bits).amax(2).flatten(0, 1) + offset
    live = torch.arange(S, device=codes.device) <= positions.long().repeat_interleave(Hkv)[:, None]
    return torch.where(live, keys, 0).to(key_dtype(key_bits))


# ---------------------------------------------------------------------------------------------- dp4a scoring

def packed_probe(probe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of the packing: probe [R, G, b] integers in [−127, 127] -> (packed [R, G, H, 8] int32,
    sums [R, G] int32), H = 2 ceil(b / 64) halves of 32 bits: byte y of packed[r, g, h, k] is p̃ of bit 32 h + 8 y + k
    (0 past b) — the bits whose 0 or 1 `(half_h >> k) & 0x01010101` holds in its bytes."""
    R, G, bits = probe.shape
    H = 2 * -(-bits // 64)
    p = torch.zeros(R, G, H * 32, dtype=torch.int64, device=probe.device)
    p[:, :, :bits] = probe.long()
    by_byte = p.view(R, G, H, 4, 8) & 255  # [R, G, h, y, k]
    word = (by_byte << (8 * torch.arange(4, device=probe.device)).view(4, 1)).sum(3)  # disjoint bytes: their OR
    return (word - ((word >> 31) << 32)).int(), probe.sum(-1).int()  # (the same 32 bits as a signed int32)


@triton.jit
def _projections(q_ptr, basis_ptr, r, w, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Projections [GP, 64] fp32 of the query heads r * G .. r * G + G - 1 (rows >= G: 0) on basis rows w * 64 ..
    w * 64 + 63 of (row, KV head) r (0 past BITS): a head at a time, each a product with the [64, D] basis tile
    summed over D. (No tl.dot: its 16-row minimum pads a group of 4 four times, and its fp32 path took 255
    registers and 9-12 us a launch on the H100.)"""
    i = tl.arange(0, 64)
    d = tl.arange(0, D)
    basis = tl.load(basis_ptr + (r * BITS + w * 64 + i)[:, None] * D + d[None, :],
                    mask=(w * 64 + i < BITS)[:, None], other=0.0)  # [64, D]
    heads = tl.arange(0, GP)
    proj = tl.zeros([GP, 64], dtype=tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (r * G + g) * D + d).to(tl.float32)  # [D]
        proj = tl.where(heads[:, None] == g, tl.sum(basis * qg[None, :], 1)[None, :], proj)
    return proj


@triton.jit
def _probe_packed_kernel(q_ptr, basis_ptr, probe_ptr, packed_ptr, sums_ptr, G: tl.constexpr, GP: tl.constexpr,
                         D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, M: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    r = tl.program_id(0)  # (row, KV head); its query heads are r * G .. r * G + G - 1
    g = tl.arange(0, GP)
    i = tl.arange(0, 64)
    top = (1 << M) - 1
    scale = 0.0
    for w in tl.static_range(W):  # the scale: max |probe| over the group and every bit
        proj = _projections(q_ptr, basis_ptr, r, w, G, GP, D, BITS)  # [GP, 64]
        scale = tl.maximum(scale, tl.max(tl.max(tl.abs(proj), 1), 0))
    scale = tl.maximum(scale, 1e-30)
    total = tl.zeros([GP], dtype=tl.int32)
    for w in tl.static_range(W):
        bit = w * 64 + i
        live = bit < BITS
        if W > 1:  # (one word: its projections are still at hand)
            proj = _projections(q_ptr, basis_ptr, r, w, G, GP, D, BITS)
        level = tl.math.div_rn(proj, scale) * top  # [GP, 64]
        p = tl.where(live[None, :], _round_half_even(level).to(tl.int32), 0)
        tl.store(probe_ptr + (r * G + g)[:, None] * BITS + bit[None, :], p, mask=(g < G)[:, None] & live[None, :])
        total += tl.sum(p, 1)
        # bit 32 h + 8 y + k -> byte y of packed word (2 w + h, k); disjoint bytes: their sum is their OR
        y = tl.arange(0, 4)
        parts = tl.reshape(p & 255, (GP, 2, 4, 8)) << (8 * y)[None, None, :, None]
        words = tl.sum(parts, 2)  # [GP, 2, 8]
        h = tl.arange(0, 2)
        k = tl.arange(0, 8)
        at = (r * G + g)[:, None, None] * (2 * W * 8) + (2 * w + h)[None, :, None] * 8 + k[None, None, :]
        tl.store(packed_ptr + at, words, mask=(g < G)[:, None, None])
    tl.store(sums_ptr + r * G + g, total, mask=g < G)


def probe_packed(q: torch.Tensor, basis: torch.Tensor, magnitude_bits: int):
    """q [B, Hq, D] (any float dtype), basis [B, Hkv, b, D] fp32, at most 7 magnitude bits -> (probe [B*Hkv, G, b]
    int32, packed [B*Hkv, G, H, 8] int32, sums [B*Hkv, G] int32): the probe of `probe_tables` (but where a level
    lies on a rounding boundary: the projections are summed in another order), packed for `score_keys_dp4a` as
    `packed_probe` packs it. One program a (row, KV head), of 16 warps: at batch 1 the eight programs of
    Llama-3.1-8B's heads are the whole launch, so its time is one program's latency, which more threads shorten
    (sm_90 SASS, `bench/kernel_registers.py --scorers`: 576 instructions a thread at 16 warps, 1,472 at 4; H100 at
    128k x 1: 3.5 us, against 9.5 for the earlier tl.dot kernel at 4 warps)."""
    B, Hq, D = q.shape
    _, Hkv, bits, _ = basis.shape
    assert magnitude_bits <= 7, "dp4a multiplies signed bytes: at most 7 magnitude bits"
    G, W, R = Hq // Hkv, -(-bits // 64), B * Hkv
    probe = torch.empty(R, G, bits, dtype=torch.int32, device=q.device)
    packed = torch.empty(R, G, 2 * W, 8, dtype=torch.int32, device=q.device)
    sums = torch.empty(R, G, dtype=torch.int32, device=q.device)
    _probe_packed_kernel[(R,)](q.contiguous(), basis.contiguous(), probe, packed, sums, G=G,
                               GP=triton.next_power_of_2(G), D=D, BITS=bits, W=W, M=magnitude_bits,
                               num_warps=16, **chained(q.device))
    return probe, packed, sums


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + Σ over the four bytes of a (unsigned) times those of b (signed): one instruction on the GPU; its
    arithmetic spelled out in the interpreter (which runs no PTX)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        out = c
        for y in tl.static_range(4):
            out += ((a >> (8 * y)) & 255) * ((b << (24 - 8 * y)) >> 24)
        return out


@triton.jit
def _score_dp4a_kernel(codes_ptr, packed_ptr, sums_ptr, positions_ptr, keys_ptr, samples_ptr, extra_ptr, extra_n_ptr,
                       S, NS, E, OFFSET, HKV: tl.constexpr, G: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
                       ASM: tl.constexpr, STRIDE: tl.constexpr, SAMPLES: tl.constexpr, EXTRA: tl.constexpr,
                       EBLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos = tl.load(positions_ptr + r // HKV)
    live = s <= pos
    row = codes_ptr + (r.to(tl.int64) * S + s) * W  # [BLOCK]: each slot's code words
    best = tl.full([BLOCK], -(1 << 30), tl.int32)
    for g in tl.static_range(G):  # (each head's loads and byte masks are the same: the compiler keeps one of each)
        head = packed_ptr + (r * G + g) * (2 * W * 8)
        acc = tl.zeros([BLOCK], dtype=tl.int32)  # Σ_i p̃_i b_i
        for w in tl.static_range(W):
            word = tl.load(row + w, mask=live, other=0)  # [BLOCK] int64
            for h in tl.static_range(2):
                half = (word >> (32 * h)).to(tl.int32)
                for k in tl.static_range(8):  # bits 8 y + k of the half, as bytes 0 or 1
                    acc = _dp4a((half >> k) & 0x01010101, tl.load(head + (2 * w + h) * 8 + k), acc, ASM)
        best = tl.maximum(best, 2 * acc - tl.load(sums_ptr + r * G + g))
    _store_keys(keys_ptr, samples_ptr, extra_ptr, extra_n_ptr, r, tl.program_id(1) * BLOCK, best + OFFSET, pos, S, NS,
                E, HKV, BLOCK, STRIDE, SAMPLES, EXTRA, EBLOCK)


def score_keys_dp4a(codes: torch.Tensor, packed: torch.Tensor, sums: torch.Tensor, positions: torch.Tensor,
                    magnitude_bits: int, bits: int, out: torch.Tensor | None = None, block: int = 1024,
                    num_warps: int = 4, samples: torch.Tensor | None = None,
                    extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """codes [B, Hkv, S, W] int64, packed / sums from `probe_packed`, positions [B] -> keys [B*Hkv, S], the same
    keys as `score_keys` (slots past a row's position are not written; `samples` and `extra` as there). Tuning:
    `block` slots and `num_warps` a program."""
    from . import interpreting

    B, Hkv, S, W = codes.shape
    G = packed.shape[1]
    offset, key_bits = key_range(bits, magnitude_bits)
    out = _keys_out(out, samples, B * Hkv, S, key_bits, codes.device)
    block = _block(block, S, samples)
    slots, counts, E, eblock = _forced_list(extra, out, B)
    _score_dp4a_kernel[(B * Hkv, triton.cdiv(S, block))](
        codes, packed, sums, positions, out, out if samples is None else samples, slots, counts, S,
        triton.cdiv(S, SAMPLE_STRIDE), E, offset, HKV=Hkv, G=G, W=W, BLOCK=block, ASM=not interpreting(),
        STRIDE=SAMPLE_STRIDE, SAMPLES=samples is not None, EXTRA=extra is not None, EBLOCK=eblock,
        num_warps=num_warps, **chained(codes.device))
    return out


# ---------------------------------------------------------------------------------------------- encoding

@triton.jit
def _encode_kernel(k_ptr, basis_ptr, codes_ptr, error_ptr, start_ptr, end_ptr, S, MAX_SLOTS, HKV: tl.constexpr,
                   D: tl.constexpr, BITS: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr):
    wait_inputs(PDL)
    r = tl.program_id(0)
    b = r // HKV
    nth = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(start_ptr + b) + nth
    live = (s < tl.load(end_ptr + b)) & (nth < MAX_SLOTS)
    d = tl.arange(0, D)
    w = tl.arange(0, WP)
    row = r.to(tl.int64) * S + s  # [BLOCK]
    residual = tl.load(k_ptr + row[:, None] * D + d[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    words = tl.zeros([BLOCK, WP], dtype=tl.int64)
    for i in range(BITS):
        p = tl.load(basis_ptr + (r * BITS + i) * D + d)  # [D]
        plus = tl.sum(residual * p[None, :], 1) >= 0  # [BLOCK]
        residual -= tl.where(plus, 1.0, -1.0)[:, None] * p[None, :]
        bit = tl.where(plus, 1, 0).to(tl.int64) << (i % 64)
        words |= tl.where(w[None, :] == i // 64, bit[:, None], 0)
    tl.store(codes_ptr + row[:, None] * W + w[None, :], words, mask=live[:, None] & (w[None, :] < W))
    tl.store(error_ptr + row, tl.sqrt(tl.sum(residual * residual, 1)), mask=live)


def encode_slots(k: torch.Tensor, basis: torch.Tensor, codes: torch.Tensor, error: torch.Tensor,
                 start: torch.Tensor, end: torch.Tensor, max_slots: int) -> None:
    """Encode the slots [start[b], end[b]) of each row (at most `max_slots`) of keys k [B, Hkv, S, D] against
    basis [B, Hkv, b, D] fp32 into codes [B, Hkv, S, W] int64 and error [B, Hkv, S] fp32, in place."""
    B, Hkv, S, D = k.shape
    bits, W = basis.shape[2], codes.shape[-1]
    block = min(64, triton.next_power_of_2(max(max_slots, 1)))
    _encode_kernel[(B * Hkv, triton.cdiv(max(max_slots, 1), block))](
        k, basis, codes, error, start, end, S, max_slots, HKV=Hkv, D=D, BITS=bits, W=W, WP=triton.next_power_of_2(W),
        BLOCK=block, num_warps=4, **chained(k.device))


def encode_slots_ref(k: torch.Tensor, basis: torch.Tensor, codes: torch.Tensor, error: torch.Tensor,
                     start: torch.Tensor, end: torch.Tensor, max_slots: int) -> None:
    """The torch reference of `encode_slots`: the policy's residual `encode` of the slots in range, in place."""
    B, Hkv, S, D = k.shape
    slots = start.long()[:, None] + torch.arange(max(max_slots, 0), device=k.device)  # [B, n]
    live = (slots < end.long()[:, None]) & (slots < S)
    slots = torch.where(live, slots, 0)
    signs, err = encode(k.gather(2, slots[:, None, :, None].expand(-1, Hkv, -1, D)), basis)  # [B, Hkv, n, b]
    rows, cols = live.nonzero(as_tuple=True)  # the reference may wait for the device
    codes[rows, :, slots[rows, cols]] = pack_bits(signs)[rows, :, cols]
    error[rows, :, slots[rows, cols]] = err[rows, :, cols]
