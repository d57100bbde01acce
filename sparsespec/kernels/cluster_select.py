"""Double-P's two top-p stages over clusters on the GPU, without a sort: masses, thresholds, flags, exact members.

The torch path (`attention/doublep.py: select_clusters`) sorts every (row, KV head)'s clusters by estimated mass
and takes prefixes. Here each top-p set is a threshold on the mass instead: clusters are ranked by the class key
k = (fp32 bits of the mass) >> 16 (the mass truncated to bf16: masses are >= 0, so the bits order as integers; one
class spans 2^-7 of relative mass), and a set takes whole classes, so no sort and no ranking of ties is needed.
Sums of masses are int64 counts of 2^-30 (`FX`), exact in any order.

    p-set:  T = the least t with K + Σ_{k_i > t} m_i < target, over valid clusters (K: the always-kept tokens' mass;
            target = p, or every cluster at p >= 1); the set is {k_i >= T} (empty when K reaches the target alone).
            It is the sorted prefix of the reference, completed to whole classes: it reaches p as the prefix does,
            with at most the rest of the last class's clusters more.
    cap:    Tc = the least t with Σ_{k_i >= t} members_i <= cap; the exact set is {k_i >= max(T2, Tc)} (at most
            `cap` CSR members: the cap's last class is left out whole).

Six launches a step, plus the attention (`DoubleP._decode_kernels`):

    kept        grid (B * Hkv,): the always-kept tokens' slots (to the front of the slot list) and exact logits
    masses      grid (B * Hkv,): the joint softmax of stage 1 (kept logits and cluster log-masses, each query head
                normalised alone, the group's mean), then the three thresholds by bisection over the class keys
                (17 passes over keys held in registers, up to 16k clusters a row)
    mark        grid (B * Hkv, runs): each cluster's flags (in p1, exact, centroid term) and, over the centroid
                terms of a run of blocks (about 4 programs per SM over all rows), the merged softmax's partial (max,
                sum, Σ e^{x_i} VΣ_i) per query head; then one program a (row, query head) merges the runs' partials
    members     grid (B * Hkv, chunks), twice: the exact clusters' prefill members in cluster order, then the
                decoded slots that joined exact clusters, appended to the slot list after the kept tokens (stream
                compaction: each chunk's count, then each chunk written after the chunks before it)

Each has its torch reference (`*_ref`), which the tests compare it against; the thresholds' reference sorts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .select import programs_per_row

FX = 1 << 30  # masses in fixed point: m -> floor(m * FX)
NONE = 1 << 16  # a threshold above every class key: the set is empty
IN_P1, EXACT, APPROX = 1, 2, 4  # flag bits


def fixed_target(p: float) -> int:
    """A top-p target in fixed point; p >= 1 takes every valid cluster whatever the rounding."""
    return 1 << 62 if p >= 1 else int(p * FX)


# ---------------------------------------------------------------------------------------------- kept tokens

@triton.jit
def _kept_kernel(q_ptr, k_ptr, pos_ptr, end_ptr, logit_ptr, idx_ptr, count_ptr, S, W, sinks, scale, stride_idx,
                 HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, WP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = r // HKV
    pos = tl.load(pos_ptr + b)
    end = tl.load(end_ptr + b)
    n_sink = tl.minimum(pos + 1, sinks)
    n = tl.minimum(n_sink + tl.maximum(pos - end + 1, 0), W)
    w = tl.arange(0, WP)
    ok = w < n
    slot = tl.where(w < n_sink, w, end + w - n_sink)
    d = tl.arange(0, D)
    keys = tl.load(k_ptr + (r * S + slot)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    for h in tl.static_range(G):
        qh = tl.load(q_ptr + (r * G + h) * D + d).to(tl.float32)
        logit = tl.sum(keys * qh[None, :], 1) * scale
        tl.store(logit_ptr + (r * G + h) * W + w, tl.where(ok, logit, float("-inf")), mask=w < W)
    tl.store(idx_ptr + r * stride_idx + w, slot.to(tl.int32), mask=ok)
    tl.store(count_ptr + r, n.to(tl.int32))


def kept_tokens(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, clustered_end: torch.Tensor, sinks: int,
                width: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The always-kept tokens of each (row, KV head): the sinks [0, min(sinks, pos + 1)) and [clustered_end, pos],
    at most `width`. Their slots go to the front of idx (in place) -> (their exact logits [R, G, width] fp32, -inf
    past each row's count; the counts [R] int32).

    q [B, Hq, D] (any float), k [B, Hkv, S, D] the cache, positions / clustered_end [B] int64, idx [R, M] int32
    (stride(-1) = 1, M >= width), R = B * Hkv."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    R, G = B * Hkv, Hq // Hkv
    assert idx.stride(-1) == 1 and q.is_contiguous() and k.is_contiguous()
    logits = torch.empty(R, G, width, dtype=torch.float32, device=q.device)
    count = torch.empty(R, dtype=torch.int32, device=q.device)
    _kept_kernel[(R,)](q, k, positions, clustered_end, logits, idx, count, S, width, sinks, D**-0.5, idx.stride(0),
                       HKV=Hkv, G=G, D=D, WP=triton.next_power_of_2(max(width, 1)), num_warps=4)
    return logits, count


def kept_slots(positions: torch.Tensor, clustered_end: torch.Tensor, sinks: int, width: int,
               heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The always-kept slots in torch (Double-P's `select`, and `kept_tokens`' reference): positions /
    clustered_end [B] -> (slots, valid) [B, heads, width]; invalid slots are 0."""
    pos, ends = positions.long()[:, None], clustered_end[:, None]  # [B, 1]
    n_sink = (pos + 1).clamp_max(sinks)
    m = torch.arange(width, device=positions.device)
    valid = (m < n_sink + (pos - ends + 1).clamp_min(0))[:, None].expand(-1, heads, -1)
    slots = torch.where(m < n_sink, m, ends + m - n_sink)[:, None].expand(-1, heads, -1).masked_fill(~valid, 0)
    return slots, valid


def kept_tokens_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, clustered_end: torch.Tensor,
                    sinks: int, width: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `kept_tokens`."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    slots, valid = kept_slots(positions, clustered_end, sinks, width, Hkv)  # [B, Hkv, W]
    m = torch.arange(width, device=q.device)
    keys = k.gather(2, slots[..., None].expand(-1, -1, -1, D)).float()  # [B, Hkv, W, D]
    logits = (q.view(B, Hkv, Hq // Hkv, D).float() @ keys.transpose(-1, -2)) * D**-0.5
    count = valid.sum(-1).view(-1)
    at = torch.where(valid, m, idx.shape[-1]).view(B * Hkv, width)
    grown = torch.cat([idx, idx.new_zeros(B * Hkv, 1)], -1).scatter_(-1, at, slots.reshape(B * Hkv, width).int())
    idx.copy_(grown[:, :-1])
    return logits.masked_fill(~valid[:, :, None], float("-inf")).view(B * Hkv, Hq // Hkv, width), count.int()


# ---------------------------------------------------------------------------------------------- masses, thresholds

@triton.jit
def _masses_kernel(ranked_ptr, size_ptr, members_ptr, kept_ptr, mass_ptr, kmass_ptr, thr_ptr, C, W, t1, t2, cap,
                   G: tl.constexpr, GP: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_T: tl.constexpr, SINGLE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GP)
    gl = g < G
    w = tl.arange(0, WP)
    kl = tl.load(kept_ptr + (r * G + g)[:, None] * W + w[None, :], mask=gl[:, None] & (w < W)[None, :],
                 other=float("-inf"))  # [GP, WP] exact logits of the kept tokens
    m = tl.max(kl, 1)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(kl - m_ref[:, None]), 1)
    for c0 in range(0, C, BLOCK):  # pass 1: each head's log-sum-exp over kept tokens and cluster log-masses
        x, _, _ = _log_masses(ranked_ptr, size_ptr, r, c0, C, G, GP, BLOCK)
        m_new = tl.maximum(m, tl.max(x, 1))
        m_new_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_new_ref) + tl.sum(tl.exp(x - m_new_ref[:, None]), 1)  # (m = -inf: s was 0)
        m, m_ref = m_new, m_new_ref
    # [GP]; +inf: a head with nothing (mass 0)
    lse = tl.where(s > 0, m_ref + tl.log(tl.where(s > 0, s, 1.0)), float("inf"))
    kept = tl.sum(tl.sum(tl.exp(kl - lse[:, None]), 1), 0) / G
    tl.store(kmass_ptr + r, kept)
    for c0 in range(0, C, BLOCK):  # pass 2: the group's mean mass of each cluster
        x, offs, ok = _log_masses(ranked_ptr, size_ptr, r, c0, C, G, GP, BLOCK)
        # an empty cluster's mass is -0.0: 0, but its bits are negative, below every threshold
        tl.store(mass_ptr + r * C + offs, tl.where(ok, tl.sum(tl.exp(x - lse[:, None]), 0) / G, -0.0),
                 mask=offs < C)
    tl.debug_barrier()  # pass 3 reads masses that other threads of this program stored
    # pass 3: the thresholds, bisected together over the class keys k in [0, 2^16]. With every cluster in one
    # block the keys and weights stay in registers across the passes; else each pass reads them again
    base = (kept * 1073741824.0).to(tl.int64)
    if SINGLE:  # (BLOCK_T >= C)
        k, fx, members = _class_weights(mass_ptr, members_ptr, r, 0, C, BLOCK_T)
    lo1 = base * 0
    lo2 = lo1
    loc = lo1
    hi1 = lo1 + 65536
    hi2 = hi1
    hic = hi1
    for _ in range(17):
        mid1 = (lo1 + hi1) // 2
        mid2 = (lo2 + hi2) // 2
        midc = (loc + hic) // 2
        if SINGLE:
            a1, a2, mc = _class_sums(k, fx, members, mid1, mid2, midc)
        else:
            a1 = base * 0
            a2 = a1
            mc = a1
            for c0 in range(0, C, BLOCK_T):
                kc, fxc, mem = _class_weights(mass_ptr, members_ptr, r, c0, C, BLOCK_T)
                s1, s2, sc = _class_sums(kc, fxc, mem, mid1, mid2, midc)
                a1 += s1.to(tl.int64)
                a2 += s2.to(tl.int64)
                mc += sc.to(tl.int64)
        take1 = base + a1 < t1
        take2 = base + a2 < t2
        takec = mc <= cap
        hi1 = tl.where(take1, mid1, hi1)
        lo1 = tl.where(take1, lo1, mid1 + 1)
        hi2 = tl.where(take2, mid2, hi2)
        lo2 = tl.where(take2, lo2, mid2 + 1)
        hic = tl.where(takec, midc, hic)
        loc = tl.where(takec, loc, midc + 1)
    tl.store(thr_ptr + r * 3, lo1)
    tl.store(thr_ptr + r * 3 + 1, lo2)
    tl.store(thr_ptr + r * 3 + 2, tl.maximum(lo2, loc))


@triton.jit
def _log_masses(ranked_ptr, size_ptr, r, c0, C, G: tl.constexpr, GP: tl.constexpr, BLOCK: tl.constexpr):
    """Clusters c0 .. c0 + BLOCK of row r -> (each head's log-mass x + log s [GP, BLOCK], -inf for an empty
    cluster or a padding head; the clusters [BLOCK]; non-empty [BLOCK])."""
    g = tl.arange(0, GP)
    offs = c0 + tl.arange(0, BLOCK)
    size = tl.load(size_ptr + r * C + offs, mask=offs < C, other=0)
    ok = size > 0
    x = tl.load(ranked_ptr + (r * G + g)[:, None] * C + offs[None, :], mask=(g < G)[:, None] & ok[None, :],
                other=float("-inf")) + tl.log(tl.maximum(size, 1).to(tl.float32))[None, :]
    return x, offs, ok


@triton.jit
def _class_weights(mass_ptr, members_ptr, r, c0, C, BLOCK: tl.constexpr):
    """A block of row r's clusters -> (class key k [BLOCK] int32, < 0 for an empty cluster; fixed-point mass and
    member count [BLOCK] int32, 0 for an empty cluster)."""
    offs = c0 + tl.arange(0, BLOCK)
    live = offs < C
    mass = tl.load(mass_ptr + r * C + offs, mask=live, other=-0.0)
    k = mass.to(tl.int32, bitcast=True) >> 16
    ok = k >= 0
    fx = tl.where(ok, (mass * 1073741824.0).to(tl.int32), 0)
    members = tl.where(ok, tl.load(members_ptr + r * C + offs, mask=live, other=0).to(tl.int32), 0)
    return k, fx, members


@triton.jit
def _add3(a1, a2, a3, b1, b2, b3):
    return a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _class_sums(k, fx, members, mid1, mid2, midc):
    """Σ fx over k > mid1, over k > mid2, and Σ members over k >= midc, in one reduction (int32: a row's fixed-point
    masses sum to at most its total mass, <= 2^30 and some rounding; its members to the cache length)."""
    return tl.reduce((tl.where(k > mid1, fx, 0), tl.where(k > mid2, fx, 0), tl.where(k >= midc, members, 0)), 0,
                     _add3)


def cluster_masses(ranked: torch.Tensor, size: torch.Tensor, members: torch.Tensor, kept_logits: torch.Tensor,
                   p1: float, p2: float, cap: int, block: int = 2048, block_t: int = 16384,
                   num_warps: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1's masses and the thresholds of both stages and the cap, one program a (row, KV head).

    ranked       [R, G, C] fp32   each query head's log-mass term of each cluster (x_i, + the spread term)
    size         [R, C] int64     cluster sizes (0: empty, never selected; log s_i is added to ranked)
    members      [R, C] int       each cluster's CSR (prefill) member count, what the cap counts
    kept_logits  [R, G, W] fp32   the kept tokens' exact logits, -inf where a row has fewer
    -> mass [R, C] fp32 (the group's mean of each head's softmax; -0.0 for an empty cluster),
       kept [R] fp32 (the kept tokens' mass),
       thresholds [R, 3] int64 (T1, T2, T_exact: the in-p1, wanted and exact sets are k >= T; `NONE`: empty)."""
    R, G, C = ranked.shape
    W = kept_logits.shape[-1]
    assert ranked.dtype == kept_logits.dtype == torch.float32 and size.shape == members.shape == (R, C)
    mass = torch.empty(R, C, dtype=torch.float32, device=ranked.device)
    kept = torch.empty(R, dtype=torch.float32, device=ranked.device)
    thr = torch.empty(R, 3, dtype=torch.int64, device=ranked.device)
    _masses_kernel[(R,)](ranked.contiguous(), size.contiguous(), members.contiguous(), kept_logits.contiguous(),
                         mass, kept, thr, C, W, fixed_target(p1), fixed_target(p2), cap, G=G,
                         GP=triton.next_power_of_2(G), WP=triton.next_power_of_2(max(W, 1)),
                         BLOCK=min(block, triton.next_power_of_2(C)),
                         BLOCK_T=min(block_t, triton.next_power_of_2(C)), SINGLE=triton.next_power_of_2(C) <= block_t,
                         num_warps=num_warps)
    return mass, kept, thr


def cluster_masses_ref(ranked: torch.Tensor, size: torch.Tensor, members: torch.Tensor, kept_logits: torch.Tensor,
                       p1: float, p2: float, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference of `cluster_masses`: the masses by softmax, the thresholds by `thresholds_ref`."""
    R, G, C = ranked.shape
    ok = size > 0
    lc = (ranked + size.clamp_min(1).float().log()[:, None]).masked_fill(~ok[:, None], float("-inf"))
    p = torch.cat([kept_logits, lc], -1).softmax(-1).nan_to_num(0.0).mean(1)  # [R, W + C]
    kept, mass = p[:, :kept_logits.shape[-1]].sum(-1), p[:, kept_logits.shape[-1]:]
    mass = torch.where(ok, mass, -0.0)
    return mass, kept, thresholds_ref(mass, kept, ok, members, p1, p2, cap)


def thresholds_ref(mass: torch.Tensor, kept: torch.Tensor, valid: torch.Tensor, members: torch.Tensor, p1: float,
                   p2: float, cap: int) -> torch.Tensor:
    """(T1, T2, T_exact) [R, 3] int64 from masses [R, C] fp32, kept [R], valid [R, C], members [R, C], by sorting
    the clusters by class key (see the module)."""
    R, C = mass.shape
    u = (mass.view(torch.int32) >> 16).long().masked_fill(~valid, -1)  # class keys; invalid last
    fx = torch.where(valid, (mass.double() * FX).long(), 0)
    base = (kept.double() * FX).long()
    order = u.argsort(dim=-1, descending=True, stable=True)
    us, fs, ms = u.gather(-1, order), fx.gather(-1, order), (members.long() * valid).gather(-1, order)
    # the mass strictly above each cluster's class: the sum over earlier entries of a larger u
    first = torch.ones_like(us, dtype=torch.bool)
    first[:, 1:] = us[:, 1:] != us[:, :-1]
    before = fs.cumsum(-1) - fs
    above = torch.where(first, before, 0).cummax(-1).values  # the class's first entry's `before`, carried on
    out = torch.empty(R, 3, dtype=torch.long, device=mass.device)
    for j, p in enumerate((p1, p2)):
        take = (base[:, None] + above < fixed_target(p)) & (us >= 0)
        out[:, j] = torch.where(take, us, NONE).amin(-1)
    # cap: the least u whose class and all above it hold <= cap members; the class's total is at its first entry
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    mem_through = ms.cumsum(-1)  # members up to and including this entry; at a class's last entry: through it
    fits = last & (mem_through <= cap) & (us >= 0)
    out[:, 2] = torch.maximum(out[:, 1], torch.where(fits, us, NONE).amin(-1))
    return out


# ---------------------------------------------------------------------------------------------- flags, centroid terms

@triton.jit
def _mark_kernel(mass_ptr, size_ptr, thr_ptr, logit_ptr, vmean_ptr, flag_ptr, m_ptr, l_ptr, acc_ptr, C, NBLK, CHUNK,
                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    t1 = tl.load(thr_ptr + r * 3)
    t2 = tl.load(thr_ptr + r * 3 + 1)
    tc = tl.load(thr_ptr + r * 3 + 2)
    g = tl.arange(0, GP)
    gl = g < G
    d = tl.arange(0, D)
    m = tl.full([GP], float("-inf"), tl.float32)  # the centroid terms' part so far, relative to e^m
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for c0 in range(blk * CHUNK, tl.minimum(blk * CHUNK + CHUNK, C), BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        live = offs < C
        size = tl.load(size_ptr + r * C + offs, mask=live, other=0)
        ok = size > 0
        u = (tl.load(mass_ptr + r * C + offs, mask=live, other=0.0).to(tl.int32, bitcast=True) >> 16).to(tl.int64)
        in_p1 = ok & (u >= t1)
        exact = ok & (u >= tc)
        if TAIL:  # the p1 set's clusters that are not exact enter as centroid terms
            approx = in_p1 & ~exact
        else:  # only the p2 set's (those the cap left out)
            approx = ok & (u >= t2) & ~exact
        tl.store(flag_ptr + r * C + offs, (in_p1.to(tl.int8) * 1 + exact.to(tl.int8) * 2 + approx.to(tl.int8) * 4),
                 mask=live)
        if tl.max(approx.to(tl.int32), 0) > 0:  # a block without centroid terms reads nothing more
            # e^{x_i} VΣ_i in the numerator, s_i e^{x_i} in the denominator
            lc = tl.load(logit_ptr + (r * G + g)[:, None] * C + offs[None, :], mask=gl[:, None] & approx[None, :],
                         other=float("-inf"))  # [GP, BLOCK]
            lw = lc + tl.log(tl.maximum(size, 1).to(tl.float32))[None, :]
            m_new = tl.maximum(m, tl.max(lw, 1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_ref)  # (m = -inf: 0)
            p = tl.exp(lw - m_ref[:, None])  # [GP, BLOCK]: s_i e^{x_i} relative to e^m, the mean value's weight
            vm = tl.load(vmean_ptr + (r * C + offs)[:, None] * D + d[None, :], mask=approx[:, None],
                         other=0.0).to(tl.float32)  # [BLOCK, D]: VΣ_i / s_i
            l = l * alpha + tl.sum(p, 1)
            # (the heads padded to 16 rows for the tensor cores; three tf32 products: fp32's accuracy)
            acc = acc * alpha[:, None] + tl.dot(p, vm, input_precision="tf32x3")
            m = m_new
    part = (r * NBLK + blk) * G + g
    tl.store(m_ptr + part, m, mask=gl)
    tl.store(l_ptr + part, l, mask=gl)
    tl.store(acc_ptr + part[:, None] * D + d[None, :], acc, mask=gl[:, None])


def mark_clusters(mass: torch.Tensor, thr: torch.Tensor, size: torch.Tensor, logits: torch.Tensor,
                  value_mean: torch.Tensor, tail_approx: bool, block: int = 32, waves: int = 4
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each cluster's flags and the centroid terms' softmax part. Each program walks a run of blocks of one row's
    clusters (about `waves` programs per SM over all rows), reading the logits and mean values only in blocks
    that hold centroid terms; one partial a program, merged by `_centroid_merge_kernel`.

    mass [R, C] fp32, thr [R, 3] int64 (from `cluster_masses`), size [R, C] int64, logits [R, G, C] fp32 (x_i),
    value_mean [R, C, D] fp32 or bf16 (VΣ_i / s_i: e^{x_i} VΣ_i = s_i e^{x_i} · mean), tail_approx: the p1 set's
    clusters outside the exact set are centroid terms (else only the p2 set's)
    -> flags [R, C] int8 (IN_P1 | EXACT | APPROX bits),
       (m [R, G], l [R, G], acc [R, G, D]) fp32: the centroid terms add e^m·acc to the numerator and e^m·l to the
       denominator (`sparse_decode_attention`'s extra; m = -inf, l = acc = 0: none)."""
    R, G, C = logits.shape
    D = value_mean.shape[-1]
    assert D >= 16, "the centroid terms' product is a tl.dot: head_dim >= 16"
    blocks = triton.cdiv(C, block)
    chunk = triton.cdiv(blocks, programs_per_row(R, blocks, mass.device, waves)) * block
    nblk = triton.cdiv(C, chunk)
    dev = mass.device
    flags = torch.empty(R, C, dtype=torch.int8, device=dev)
    pm = torch.empty(R, nblk, G, dtype=torch.float32, device=dev)
    pl, pacc = torch.empty_like(pm), torch.empty(R, nblk, G, D, dtype=torch.float32, device=dev)
    _mark_kernel[(R, nblk)](mass, size.contiguous(), thr, logits.contiguous(), value_mean.contiguous(), flags, pm, pl,
                            pacc, C, nblk, chunk, G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BLOCK=block,
                            TAIL=tail_approx, num_warps=4)
    m = torch.empty(R, G, dtype=torch.float32, device=dev)
    l, acc = torch.empty_like(m), torch.empty_like(pacc[:, 0])
    _centroid_merge_kernel[(R * G,)](pm, pl, pacc, m, l, acc, nblk, G=G, D=D, CH=min(64, triton.next_power_of_2(nblk)),
                                     num_warps=4)
    return flags, (m, l, acc)


def mark_clusters_ref(mass: torch.Tensor, thr: torch.Tensor, size: torch.Tensor, logits: torch.Tensor,
                      value_mean: torch.Tensor, tail_approx: bool
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The torch reference of `mark_clusters`."""
    ok = size > 0
    u = (mass.view(torch.int32) >> 16).long()
    in_p1, wanted, exact = (ok & (u >= thr[:, j:j + 1]) for j in range(3))
    approx = (in_p1 if tail_approx else wanted) & ~exact
    flags = (in_p1.to(torch.int8) * IN_P1 + exact.to(torch.int8) * EXACT + approx.to(torch.int8) * APPROX)
    lc = logits.masked_fill(~approx[:, None], float("-inf"))  # [R, G, C]
    lw = lc + size.clamp_min(1).float().log()[:, None]
    m = lw.amax(-1)
    top = m.masked_fill(torch.isinf(m), 0.0)[..., None]
    w = (lw - top).exp()  # [R, G, C]: s_i e^{x_i} relative to e^m
    return flags, (m, w.sum(-1), w @ value_mean.float())


# ---------------------------------------------------------------------------------------------- exact members

@triton.jit
def _kept_members(perm_ptr, mcl_ptr, flag_ptr, pre_ptr, assign_ptr, end_ptr, r, chunk, C, N, NCH, S, DW,
                  HKV: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk `chunk` of row r's exact slots -> (slots, keep) [CHUNK]. Chunks below NCH: the CSR list, members of
    exact clusters below csr_end; the rest: the decoded clustered slots [csr_end, clustered_end) (at most DW) whose
    recorded cluster is exact."""
    pre = tl.load(pre_ptr + r // HKV)
    if chunk < NCH:
        at = chunk * CHUNK + tl.arange(0, CHUNK)
        member_of = tl.load(mcl_ptr + r * N + at, mask=at < N, other=C)
        listed = member_of < C
        exact = (tl.load(flag_ptr + r * C + member_of, mask=listed, other=0) & 2) != 0
        slot = tl.load(perm_ptr + r * N + at, mask=listed & exact, other=0)
        keep = listed & exact & (slot < pre)  # EXACT, not rolled back
    else:
        d = (chunk - NCH) * CHUNK + tl.arange(0, CHUNK)
        live = (d < DW) & (d < tl.load(end_ptr + r // HKV) - pre)
        slot = pre + d
        joined = tl.load(assign_ptr + r * S + slot, mask=live, other=-1)
        live = live & (joined >= 0)
        keep = live & ((tl.load(flag_ptr + r * C + joined, mask=live, other=0) & 2) != 0)
    return slot, keep


@triton.jit
def _members_count_kernel(perm_ptr, mcl_ptr, flag_ptr, pre_ptr, assign_ptr, end_ptr, part_ptr, C, N, NCH, S, DW,
                          NALL, HKV: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    _, keep = _kept_members(perm_ptr, mcl_ptr, flag_ptr, pre_ptr, assign_ptr, end_ptr, r, chunk, C, N, NCH, S, DW,
                            HKV, CHUNK)
    tl.store(part_ptr + r * NALL + chunk, tl.sum(keep.to(tl.int32), 0))


@triton.jit
def _members_write_kernel(perm_ptr, mcl_ptr, flag_ptr, pre_ptr, assign_ptr, end_ptr, part_ptr, idx_ptr, count_ptr,
                          out_ptr, C, N, NCH, S, DW, NALL, stride_idx, HKV: tl.constexpr, CHUNK: tl.constexpr,
                          NALL_P: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot, keep = _kept_members(perm_ptr, mcl_ptr, flag_ptr, pre_ptr, assign_ptr, end_ptr, r, chunk, C, N, NCH, S,
                               DW, HKV, CHUNK)
    j = tl.arange(0, NALL_P)
    counts = tl.load(part_ptr + r * NALL + j, mask=j < NALL, other=0)
    base = tl.load(count_ptr + r) + tl.sum(tl.where(j < chunk, counts, 0), 0)
    k32 = keep.to(tl.int32)
    tl.store(idx_ptr + r * stride_idx + base + tl.cumsum(k32, 0) - k32, slot.to(tl.int32), mask=keep)
    if chunk == 0:
        tl.store(out_ptr + r, tl.load(count_ptr + r) + tl.sum(counts, 0))


def append_exact_members(perm: torch.Tensor, member_cluster: torch.Tensor, flags: torch.Tensor,
                         csr_end: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
                         assign: torch.Tensor | None = None, clustered_end: torch.Tensor | None = None,
                         decoded_width: int = 0, chunk: int = 1024) -> torch.Tensor:
    """After the count[r] slots already in idx[r] (in place), the slots attended exactly for the exact clusters ->
    the new counts [R] int32: the prefill members of each exact cluster, cluster by cluster in CSR order, that lie
    below their row's csr_end; then the decoded slots [csr_end, clustered_end) (at most `decoded_width`) whose
    recorded cluster is exact. Two launches over chunks of both lists: the kept slots of each chunk counted, then
    written after the chunks before them.

    perm [R, N] int64 (CSR member slots), member_cluster [R, N] int32 (each entry's cluster; C: padding),
    flags [R, C] int8 (`mark_clusters`), csr_end / clustered_end [B] int64 (R = B * Hkv), assign [R, S] int64
    (each clustered slot's cluster, -1 elsewhere), idx [R, M] int32 (stride(-1) = 1; M must hold every slot
    appended), count [R] int32."""
    R, N = perm.shape
    C = flags.shape[-1]
    assert idx.stride(-1) == 1 and count.is_contiguous() and count.dtype == idx.dtype == torch.int32
    if assign is None:
        assign, clustered_end, decoded_width = perm, csr_end, 0
    chunk = min(chunk, triton.next_power_of_2(max(N, decoded_width, 1)))
    nch = triton.cdiv(max(N, 1), chunk)
    nall = nch + triton.cdiv(decoded_width, chunk)
    part = torch.empty(R, nall, dtype=torch.int32, device=perm.device)
    out = torch.empty_like(count)
    args = (perm.contiguous(), member_cluster.contiguous(), flags, csr_end, assign, clustered_end)
    sizes = (C, N, nch, assign.shape[-1], decoded_width, nall)
    _members_count_kernel[(R, nall)](*args, part, *sizes, HKV=R // csr_end.shape[0], CHUNK=chunk, num_warps=4)
    _members_write_kernel[(R, nall)](*args, part, idx, count, out, *sizes, idx.stride(0), HKV=R // csr_end.shape[0],
                                     CHUNK=chunk, NALL_P=triton.next_power_of_2(nall), num_warps=4)
    return out


def append_exact_members_ref(perm: torch.Tensor, member_cluster: torch.Tensor, flags: torch.Tensor,
                             csr_end: torch.Tensor, idx: torch.Tensor, count: torch.Tensor,
                             assign: torch.Tensor | None = None, clustered_end: torch.Tensor | None = None,
                             decoded_width: int = 0) -> torch.Tensor:
    """The torch reference of `append_exact_members`."""
    R, C = flags.shape
    per_row = R // csr_end.shape[0]
    pre = csr_end.repeat_interleave(per_row)[:, None]  # [R, 1]
    ok = member_cluster < C
    exact = (flags.gather(-1, member_cluster.long().clamp_max(C - 1)) & EXACT) != 0
    slots, keep = perm, ok & exact & (perm < pre)
    if assign is not None and decoded_width > 0:
        d = torch.arange(decoded_width, device=perm.device)
        dec = pre + d  # [R, W2]
        live = d < clustered_end.repeat_interleave(per_row)[:, None] - pre
        cluster = assign.gather(-1, dec.clamp_max(assign.shape[-1] - 1)).masked_fill(~live, -1)
        dec_keep = (cluster >= 0) & ((flags.gather(-1, cluster.clamp_min(0)) & EXACT) != 0)
        slots, keep = torch.cat([perm, dec], -1), torch.cat([keep, dec_keep], -1)
    at = torch.where(keep, count[:, None].long() + keep.long().cumsum(-1) - 1, idx.shape[-1])
    grown = torch.cat([idx, idx.new_zeros(R, 1)], -1).scatter_(-1, at, slots.int())
    idx.copy_(grown[:, :-1])
    return count + keep.sum(-1).int()


# ---------------------------------------------------------------------------------------------- centroid terms

@triton.jit
def _centroid_merge_kernel(pm_ptr, pl_ptr, pacc_ptr, m_ptr, l_ptr, acc_ptr, NBLK, G: tl.constexpr, D: tl.constexpr,
                           CH: tl.constexpr):
    rg = tl.program_id(0).to(tl.int64)  # r * G + g
    r = rg // G
    g = rg % G
    j = tl.arange(0, CH)
    m = tl.full([CH], float("-inf"), tl.float32)
    for j0 in range(0, NBLK, CH):
        m = tl.maximum(m, tl.load(pm_ptr + (r * NBLK + j0 + j) * G + g, mask=j0 + j < NBLK, other=float("-inf")))
    top = tl.max(m, 0)
    ref = tl.where(top == float("-inf"), 0.0, top)
    d = tl.arange(0, D)
    l = tl.zeros([CH], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for j0 in range(0, NBLK, CH):
        live = j0 + j < NBLK
        part = (r * NBLK + j0 + j) * G + g
        w = tl.exp(tl.load(pm_ptr + part, mask=live, other=float("-inf")) - ref)  # [CH]; no terms: 0
        l += w * tl.load(pl_ptr + part, mask=live, other=0.0)
        acc += tl.sum(w[:, None] * tl.load(pacc_ptr + part[:, None] * D + d[None, :], mask=live[:, None],
                                           other=0.0), 0)
    tl.store(m_ptr + rg, top)
    tl.store(l_ptr + rg, tl.sum(l, 0))
    tl.store(acc_ptr + rg * D + d, acc)
