"""Double-P: hierarchical top-p sparse decode attention over k-means clusters of the keys.

Build (end of prefill), per (row, layer, KV head): the prefill keys outside the sinks and the recent window are
clustered by k-means, ceil(n / cluster_size) clusters for n candidates. Cluster i keeps its centroid C_i (the mean
of its members' keys), size s_i, value sum VΣ_i = Σ v_j, and its prefill members' slots grouped contiguously
(CSR: cluster i's members are perm[offsets[i]:offsets[i + 1]]).

Decode, one query per row:
  stage 1  x_i = q·C_i/√D. One softmax over the exact logits of the always-kept tokens (sinks, recent window,
           decoded tokens not clustered, the current token) together with the cluster log-weights x_i + log s_i
           gives the kept mass K and the estimated cluster masses Â_i (Σ Â_i + K = 1). The kept mass counts
           first toward p1: clusters are taken in decreasing Â until K + Σ Â ≥ p1 — the smallest such prefix,
           empty when K ≥ p1 already.
  stage 2  The leading clusters of that set (same order) until K + Σ Â ≥ p2 (p2_of="total"), or
           ≥ p2 · (K + Σ_{p1 set} Â) (p2_of="selected"), are attended exactly, token by token. The rest of the
           p1 set enter as centroid terms, e^{x_i} VΣ_i in the numerator and s_i e^{x_i} in the denominator
           (tail="approx"), or are dropped (tail="drop"). Clusters outside the p1 set are dropped.
  merged_attention computes both parts in one numerically stable softmax.

estimate="spread" (the default; "centroid" keeps the paper's estimate alone): the size-weighted centroid
under-estimates a cluster whose keys spread along q (Jensen: log Σ_j e^{q·k_j/√D} ≥ x_i + log s_i), which is where
a lone needle key hides. With a Gaussian model of the
cluster's keys (mean C_i, per-dimension variance var_i, kept from the members' sum of squares) the log-mass is
x_i + log s_i + ½ Σ_d q_d² var_{i,d} / D; stage 1 and 2 rank and count clusters by that. Only the selection changes:
the centroid terms of the merged softmax stay s_i e^{x_i}.

GQA: the estimated masses of a KV head's G query heads are averaged (the group's mean mass, i.e. the sum over
heads / G); each KV head selects one cluster set, shared by its query heads. p = 1 keeps every cluster whatever
the rounding of the prefix sums, so p1 = p2 = 1 is dense attention.

Decoded tokens (decoded="assign"): a token leaving the recent window joins the nearest non-empty centroid of its
KV head (the centroids as they were before that append; centroids equidistant up to rounding, duplicates included,
tie to the lowest index whatever the BLAS); the cluster's key sum, size and value sum grow and its
centroid becomes the new mean. Every clustered slot remembers its cluster, so a rollback subtracts the tokens past
the new boundary again (their keys are read back from the cache: call append on a rollback before the rolled-back
slots are overwritten, or roll back at most `window` tokens). A row whose prefill left no candidates keeps its
decoded tokens exact. decoded="window": decoded tokens are never clustered (a growing exact window).
decoded="recluster": as "assign", and once `recluster_every` decoded tokens have joined clusters in some row, the
layer is clustered again from scratch (as at the end of prefill) over everything outside the sinks and the window.
Empty clusters (k-means can leave some) keep their last centroid, have size 0 and never take part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache import KVCache
from ..errors import SparseSpecError
from ..kernels import triton_ready
from ..kernels.cluster_select import kept_slots
from ..kernels.kmeans import PRECISIONS, nearest_centroid
from .policy import Policy, PolicyOptions, device_ints, option

_CHUNK = 1 << 19  # elements of one [G, n, k] distance block in `nearest` (a few MB: the CPU's caches)
_CHOICES = {"p2_of": ("total", "selected"), "tail": ("approx", "drop"), "decoded": ("assign", "window", "recluster"),
            "estimate": ("spread", "centroid"), "index_dtype": ("auto", "float32", "bfloat16"),
            "kmeans_dot": ("auto", *PRECISIONS)}


@dataclass(frozen=True)
class DoublePOptions(PolicyOptions):
    sinks: int = 4
    window: int = 64
    # defaults (0.99, 0.9, 8): the setting that held up in the fidelity proxy, the task subset and long generation
    # (docs/results/doublep.md, longgen.md); the paper's (0.95, 0.7, 16) looped on a long essay
    p1: float = option(0.99, "cluster-level top-p: the selected set (kept tokens + clusters) reaches this "
                             "estimated mass")
    p2: float = option(0.9, "the part of the mass attended exactly, token by token")
    cluster_size: int = option(8, "target average tokens per cluster")
    kmeans_iters: int = option(2, "k-means iterations per clustering (2 cost 1% more exact keys and 0.001-0.002 of "
                                  "output error against 10 in the fidelity measurements, and fit the build in 5% of "
                                  "the prefill on the H200: docs/results/doublep.md)")
    seed: int = option(0, "seed of the k-means starts")
    p2_of: str = option("total", "p2 against the total estimated mass, or selected: against the p1 set's mass")
    tail: str = option("approx", "p1 clusters outside the p2 set: approx (centroid terms) or drop")
    # "recluster": decoded tokens join the nearest cluster, and k-means is run again over everything outside the
    # sinks and the window once `recluster_every` tokens have joined since the last clustering
    decoded: str = option("assign", "decoded tokens leaving the window: assign (join the nearest cluster), "
                                    "window (stay exact) or recluster (assign, and re-run k-means now and then)")
    recluster_every: int = option(256, "decoded=recluster: re-run k-means once this many tokens have joined")
    # "spread": x_i + log s_i plus the cluster's second-order term ½ Σ_d q_d² var_{i,d} / D (Jensen's gap of a
    # Gaussian cluster with diagonal covariance); "centroid": x_i + log s_i alone (the paper's size-weighted
    # centroid, which loses needles: docs/results/doublep.md)
    estimate: str = option("spread", "cluster log-mass for the selection: spread (centroid + variance term) or "
                                     "centroid")
    kmeans_dot: str = option("auto", "k-means distances' dot products: ieee (fp32), tf32 or bf16 (inputs rounded to "
                                     "10- or 8-bit mantissas: the tensor cores on CUDA, emulated on the CPU; a point "
                                     "nearly equidistant from two centroids may join either); auto: bf16 where the "
                                     "Triton kernels run, ieee elsewhere")
    kmeans_sample: float = option(1.0, "share of each row's keys (those of largest random draw) that the k-means "
                                       "iterations before the last run on; the last assigns every key")
    index_dtype: str = option("auto", "dtype of the centroids and variances a step reads: auto (bfloat16 on CUDA, "
                                      "float32 elsewhere), float32 or bfloat16; the sums they are computed from, "
                                      "which appends and rollbacks update, stay float32")
    exact_cap: float = option(0.1, "fixed-width (graph-captured) steps: at most this share of the cache capacity "
                                   "(a count if > 1; at least min_tokens) of prefill tokens attended token by token; "
                                   "exact clusters past it, in rank order, enter as centroid terms (p2 = 1: no cap)")
    min_tokens: int = option(256, "fixed-width steps: exact_cap is at least this many tokens")

    def __post_init__(self):
        super().__post_init__()
        if self.min_tokens < 0:
            raise SparseSpecError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("p1", "p2"):
            if not 0 < getattr(self, name) <= 1:
                raise SparseSpecError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.p2 > self.p1:
            raise SparseSpecError(f"p2 must be <= p1, got p2={self.p2} > p1={self.p1}")
        if self.cluster_size < 1:
            raise SparseSpecError(f"cluster_size must be >= 1, got {self.cluster_size}")
        if self.kmeans_iters < 1:
            raise SparseSpecError(f"kmeans_iters must be >= 1, got {self.kmeans_iters}")
        if not 0 < self.kmeans_sample <= 1:
            raise SparseSpecError(f"kmeans_sample must be in (0, 1], got {self.kmeans_sample}")
        if self.recluster_every < 1:
            raise SparseSpecError(f"recluster_every must be >= 1, got {self.recluster_every}")
        if not 0 < self.exact_cap < float("inf"):
            raise SparseSpecError(f"exact_cap must be a positive number, got {self.exact_cap}")
        if self.select_every != 1:
            raise SparseSpecError("select_every is not supported by doublep (its selection is per step)")
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise SparseSpecError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")


# ---------------------------------------------------------------------------------------------- clustering

def nearest(points: torch.Tensor, centroids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """points [G, N, D], centroids [G, k, D] (fp32) -> index of the nearest centroid [G, N] int64 (squared
    Euclidean distance; a centroid with valid [G, k] False is never chosen unless none is valid).

    Ties go to the lowest index: centroids whose distance differs from the nearest one's by less than a bound on
    the rounding error of the distance computation (a matmul expansion, whose rounding depends on the BLAS and on
    where a point and a centroid sit in the matrices) count as tied. So duplicate centroids (k-means starts from k
    distinct slots, not k distinct keys) and centroids a few ulps apart get the same index on every machine; only a
    pair whose true gap lies within rounding of that bound (about 4 (D + 1) u of the squared norms) can still go
    either way."""
    G, N, D = points.shape
    k = centroids.shape[1]
    # distances are shift-invariant: centring on the points' mean keeps the expansion (and its error bound) small
    offset = points.mean(1, keepdim=True)
    points, centroids = points - offset, centroids - offset
    c2 = centroids.pow(2).sum(-1)  # [G, k]
    bias = -c2
    if valid is not None:
        bias = bias.masked_fill(~valid, float("-inf"))
        c2 = c2.masked_fill(~valid, 0.0)
    # |rounding error| of one score 2 p·c − ‖c‖² in fp32, in any summation order, with or without FMA:
    # ≲ (D + 1) u (‖p‖² + 2‖c‖²), u = eps / 2. Two tied scores come out at most twice that apart; the tolerance is
    # twice that again (the norms it is computed from are rounded too).
    rel = 2 * (D + 1) * torch.finfo(torch.float32).eps
    reach = 2 * c2.amax(-1, keepdim=True)  # [G, 1]
    step = max(1, _CHUNK // max(1, G * k))
    out = torch.empty(G, N, dtype=torch.long, device=points.device)
    for s in range(0, N, step):
        p = points[:, s:s + step]
        # [G, n, k]: ‖p‖² − ‖p − c‖², larger = nearer
        score = 2 * p @ centroids.transpose(1, 2) + bias[:, None]
        tol = rel * (p.pow(2).sum(-1) + reach)  # [G, n]
        tied = score >= score.amax(-1, keepdim=True) - tol[..., None]
        out[:, s:s + step] = tied.to(torch.uint8).argmax(-1)  # the first of the tied centroids
    return out


def cluster_sums(x: torch.Tensor, assign: torch.Tensor, k: int,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [G, N, D], assign [G, N] in [0, k), valid [G, N] bool or None (points that count)
    -> (member sums [G, k, D] fp32, sizes [G, k] int64)."""
    G, _, D = x.shape
    rows = k
    if valid is not None:  # padding goes to an extra row, dropped (whatever it holds, inf or NaN, stays out)
        assign, rows = torch.where(valid, assign, k), k + 1
    sums = torch.zeros(G, rows, D, device=x.device).scatter_add_(1, assign[..., None].expand(-1, -1, D), x.float())
    sizes = torch.zeros(G, rows, dtype=torch.long, device=x.device).scatter_add_(1, assign, torch.ones_like(assign))
    return sums[:, :k].contiguous(), sizes[:, :k].contiguous()


def kmeans(keys: torch.Tensor, k: int, iters: int, generator: torch.Generator | None,
           valid: torch.Tensor | None = None, ks: torch.Tensor | None = None, precision: str = "ieee",
           draws: torch.Tensor | None = None, sample: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means, batched over G entries (heads, rows x heads). keys [G, N, D], valid [G, N] bool (the
    entry's points; None: all), ks [G] (the entry's cluster count, <= k and <= its points; None: k each)
    -> (centroids [G, k, D] fp32, assign [G, N] int64; an entry's centroids from ks[g] on, and the assignment of
    points that are not valid, mean nothing).

    Starts from ks[g] distinct random valid points: those with the largest of `draws` [G, N] (uniform numbers; None:
    drawn from `generator`, on its device);
    each of the `iters` steps assigns every point to its nearest centroid, then moves each centroid to the mean of
    its members (an empty cluster keeps its centroid); with `sample` < 1 the steps before the last take only each
    entry's m = max(k, ⌈sample·N⌉) points of largest draw (the starts among them; all of a shorter entry's), the
    last every point. The returned centroids are the means of the returned assignment's clusters. On CUDA the
    assignment is the Triton kernel, on CPU the tie-tolerant `nearest` (the same clusters on every CPU; CUDA draws
    its starts from its own generator, so its clusters differ from the CPU's); `precision` (`nearest_centroid`'s)
    rounds the dot products' inputs, on the CPU by rounding them to nearest first."""
    G, N, D = keys.shape
    if not 1 <= k <= N:
        raise SparseSpecError(f"k-means needs 1 <= k <= {N} points, got k={k}")
    # distances are shift-invariant; centring (on the entry's own points) keeps them precise
    x = keys.float()
    offset = x.mean(1, keepdim=True) if valid is None else \
        torch.where(valid[..., None], x, 0.0).sum(1, keepdim=True) / valid.sum(1).clamp_min(1)[:, None, None]
    x = x - offset
    if valid is not None:
        x = torch.where(valid[..., None], x, 0.0)  # padding: whatever it held, it takes no part
    if draws is None:
        draws = torch.rand(G, N, generator=generator, device=generator.device)
    draws = draws.to(keys.device)
    if valid is not None:
        draws = draws.masked_fill(~valid, -1.0)  # valid points first
    # distinct points in decreasing draw; equal draws (24-bit uniforms do collide) in slot order, whatever the width
    order = draws.sort(dim=1, descending=True, stable=True).indices  # [G, N]
    centroids = x.gather(1, order[:, :k, None].expand(-1, -1, D))
    usable = None if ks is None else torch.arange(k, device=keys.device) < ks[:, None]  # [G, k]
    m = N if sample >= 1 else min(N, max(k, math.ceil(sample * N)))
    part, part_valid = x, valid
    if m < N:  # the sample: the m points of largest draw
        part = x.gather(1, order[:, :m, None].expand(-1, -1, D))  # [G, m, D]
        part_valid = None if valid is None else valid.gather(1, order[:, :m])
    for i in range(iters):
        pts, pts_valid = (x, valid) if i == iters - 1 else (part, part_valid)
        if triton_ready(keys.device):
            assign = nearest_centroid(pts, centroids, usable, precision, centre=False)  # (x is centred already)
        else:
            assign = nearest(_rounded_to(pts, precision), _rounded_to(centroids, precision), usable)
        sums, sizes = cluster_sums(pts, assign, k, pts_valid)
        centroids = torch.where(sizes[..., None] > 0, sums / sizes.clamp_min(1)[..., None], centroids)
    return centroids + offset, assign


def _rounded_to(x: torch.Tensor, precision: str) -> torch.Tensor:
    """fp32 x with its mantissa rounded to nearest (ties to even) as `precision` ("ieee": as it is) holds it."""
    if precision == "bf16":
        return x.to(torch.bfloat16).float()
    if precision == "tf32":  # 10 of fp32's 23 mantissa bits
        bits = x.view(torch.int32)
        return ((bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)
    return x


# ---------------------------------------------------------------------------------------------- selection

def estimate_masses(kept_logits: torch.Tensor, kept_valid: torch.Tensor, cent_logit: torch.Tensor,
                    cent_logsize: torch.Tensor, cent_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's joint softmax. kept_logits [B, Hkv, G, W] (exact q·k/√D of the always-kept tokens), kept_valid
    [B, Hkv, W], cent_logit [B, Hkv, G, C] (x_i), cent_logsize [B, Hkv, C], cent_valid [B, Hkv, C]
    -> (kept mass K [B, Hkv], cluster masses Â [B, Hkv, C]) fp32, each averaged over the G query heads."""
    W = kept_logits.shape[-1]
    lk = kept_logits.float().masked_fill(~kept_valid[:, :, None], float("-inf"))
    lc = (cent_logit.float() + cent_logsize[:, :, None]).masked_fill(~cent_valid[:, :, None], float("-inf"))
    p = torch.cat([lk, lc], -1).softmax(-1).mean(2)  # [B, Hkv, W + C]
    return p[..., :W].sum(-1), p[..., W:]


def top_p_prefix(mass: torch.Tensor, valid: torch.Tensor, base: torch.Tensor, p: float,
                 total: torch.Tensor | None = None) -> torch.Tensor:
    """The smallest set of valid clusters, taken in decreasing mass, with base + Σ mass ≥ p · total.
    mass [..., C], valid [..., C] bool, base [...] (mass already counted), total [...] (1 if None)
    -> bool [..., C]. p ≥ 1 takes every valid cluster; a base already reaching the target takes none. Equal
    masses rank the lower index first."""
    if p >= 1:
        return valid.clone()
    target = p if total is None else p * total.unsqueeze(-1)
    order = mass.masked_fill(~valid, -1.0).argsort(dim=-1, descending=True, stable=True)
    ok = valid.gather(-1, order)
    ranked = mass.gather(-1, order).masked_fill(~ok, 0.0)
    before = ranked.cumsum(-1) - ranked  # mass of the higher-ranked clusters
    take = ok & (base.unsqueeze(-1) + before < target)
    return torch.zeros_like(valid).scatter(-1, order, take)


def capped(exact: torch.Tensor, mass: torch.Tensor, members: torch.Tensor, cap: int) -> torch.Tensor:
    """The exact clusters that fit a cap on their members, taken in decreasing mass (ties: lower index): exact
    [..., C] bool, mass [..., C], members [..., C] (each cluster's member count) -> bool [..., C] ⊆ exact."""
    order = mass.masked_fill(~exact, -1.0).argsort(dim=-1, descending=True, stable=True)
    ranked = (members * exact).gather(-1, order)
    fits = exact.gather(-1, order) & (ranked.cumsum(-1) <= cap)
    return torch.zeros_like(exact).scatter(-1, order, fits)


def select_clusters(mass: torch.Tensor, valid: torch.Tensor, base: torch.Tensor, p1: float, p2: float,
                    selected: bool, members: torch.Tensor, cap: int | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both top-p stages and the cap from one sort: mass / valid [..., C], base [...] (the kept tokens' mass),
    members [..., C] (each cluster's CSR member count) -> (in_p1, wanted, exact) bool [..., C], the same sets as

        in_p1  = top_p_prefix(mass, valid, base, p1)
        wanted = top_p_prefix(mass, in_p1, base, p2, base + Σ mass·in_p1 if selected else None)
        exact  = wanted if cap is None else capped(wanted, mass, members, cap)

    Each set is a prefix of the one before in the same order (decreasing mass, ties to the lower index), so one
    ranking serves all three (the references sort three times)."""
    order = mass.masked_fill(~valid, -1.0).argsort(dim=-1, descending=True, stable=True)
    ok = valid.gather(-1, order)
    ranked = mass.gather(-1, order)

    def prefix(within: torch.Tensor, p: float, target: torch.Tensor | float) -> torch.Tensor:  # sorted order
        if p >= 1:
            return within
        taken = ranked.masked_fill(~within, 0.0)
        return within & (base.unsqueeze(-1) + (taken.cumsum(-1) - taken) < target)

    back = lambda t: torch.zeros_like(valid).scatter(-1, order, t)  # noqa: E731  sorted order -> clusters
    in_p1 = prefix(ok, p1, p1)
    p1_set = back(in_p1)
    total = base + (mass * p1_set).sum(-1) if selected else None
    wanted = prefix(in_p1, p2, p2 if total is None else p2 * total.unsqueeze(-1))
    exact = wanted if cap is None else wanted & ((members.gather(-1, order) * wanted).cumsum(-1) <= cap)
    return p1_set, back(wanted), back(exact)


def csr_members(perm: torch.Tensor, offsets: torch.Tensor, chosen: torch.Tensor,
                width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The member slots of the chosen clusters, each cluster's gathered contiguously. perm [B, Hkv, N], offsets
    [B, Hkv, C + 1], chosen [B, Hkv, C] bool -> (slots [B, Hkv, M], valid [B, Hkv, M]); invalid slots are 0.
    M: the most members any (row, KV head) has (read back), or `width` (static; members past it are cut)."""
    counts = (offsets[..., 1:] - offsets[..., :-1]) * chosen  # [B, Hkv, C]
    ends = counts.cumsum(-1)
    M = int(ends[..., -1].max()) if width is None else width
    m = torch.arange(M, device=perm.device).expand(*ends.shape[:2], M).contiguous()  # [B, Hkv, M]
    cluster = torch.searchsorted(ends, m, right=True).clamp(max=ends.shape[-1] - 1)  # which chosen cluster
    within = m - (ends.gather(-1, cluster) - counts.gather(-1, cluster))
    valid = m < ends[..., -1:]
    at = (offsets.gather(-1, cluster) + within).clamp(max=perm.shape[-1] - 1)
    return perm.gather(-1, at).masked_fill(~valid, 0), valid


def merged_attention(q: torch.Tensor, exact_k: torch.Tensor, exact_v: torch.Tensor, exact_valid: torch.Tensor,
                     cent_logit: torch.Tensor, cent_logsize: torch.Tensor, cent_vsum: torch.Tensor,
                     cent_valid: torch.Tensor) -> torch.Tensor:
    """One softmax over exact tokens and centroid terms, in fp32 after subtracting the max of both parts:

        o = (Σ_j e^{l_j} v_j + Σ_i e^{x_i} VΣ_i) / (Σ_j e^{l_j} + Σ_i s_i e^{x_i}),   l_j = q·k_j/√D

    q [B, Hq, 1, D]; exact_k/exact_v [B, Hkv, M, D], exact_valid [B, Hkv, M]; cent_logit [B, Hq, C] (x_i per query
    head), cent_logsize [B, Hkv, C] or [B, Hq, C] (log s_i), cent_vsum [B, Hkv, C, D], cent_valid [B, Hkv, C]
    -> [B, Hq, 1, D] in q's dtype. A head with nothing valid outputs zeros."""
    B, Hq, _, D = q.shape
    Hkv, C = exact_k.shape[1], cent_logit.shape[-1]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G, D).float()
    le = (qg @ exact_k.float().transpose(-1, -2)) * D**-0.5  # [B, Hkv, G, M]
    le = le.masked_fill(~exact_valid[:, :, None], float("-inf"))
    lc = cent_logit.reshape(B, Hkv, G, C).float()
    ls = cent_logsize.float().reshape(B, Hkv, -1, C)  # [B, Hkv, 1 or G, C]
    lc = lc.masked_fill(~cent_valid[:, :, None], float("-inf"))
    lw = lc + ls  # log(s_i e^{x_i}): the denominator's centroid terms
    top = torch.cat([le, lw], -1).amax(-1, keepdim=True)  # [B, Hkv, G, 1]
    top = top.masked_fill(torch.isinf(top), 0.0)
    pe, pc = (le - top).exp(), (lc - top).exp()  # lc ≤ lw ≤ top: no overflow
    den = pe.sum(-1) + (lw - top).exp().sum(-1)  # [B, Hkv, G]
    num = pe @ exact_v.float() + pc @ cent_vsum.float()  # [B, Hkv, G, D]
    out = num / den.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    return out.reshape(B, Hq, 1, D).to(q.dtype)


def merged_attention_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                            valid: torch.Tensor, cent_logit: torch.Tensor, cent_logsize: torch.Tensor,
                            cent_vsum: torch.Tensor, cent_valid: torch.Tensor) -> torch.Tensor:
    """`merged_attention` reading K/V in place through the slot list (the CUDA path): the valid slots compacted to
    the front of each (row, KV head), Triton's split-K sparse flash-decoding over them, and the centroid terms as
    one more split of its log-sum-exp merge. q [B, Hq, 1, D], k/v [B, Hkv, S, D] (the cache), slots / valid
    [B, Hkv, M], the centroid arguments as `merged_attention` -> [B, Hq, 1, D] in q's dtype."""
    from ..kernels.attend import sparse_decode_attention

    B, Hq, _, D = q.shape
    Hkv, M = slots.shape[1], slots.shape[2]
    G, C = Hq // Hkv, cent_logit.shape[-1]
    at = torch.where(valid, valid.cumsum(-1) - 1, M)  # each valid slot's column; the invalid spill into column M
    idx = torch.zeros(B, Hkv, M + 1, dtype=torch.int32, device=q.device).scatter_(-1, at, slots.int())[..., :M]
    count = valid.sum(-1).int()  # [B, Hkv]
    lc = cent_logit.reshape(B, Hkv, G, C).float().masked_fill(~cent_valid[:, :, None], float("-inf"))
    lw = lc + cent_logsize.float().reshape(B, Hkv, -1, C)  # log(s_i e^{x_i})
    m = lw.amax(-1)  # [B, Hkv, G]
    top = m.masked_fill(torch.isinf(m), 0.0)[..., None]
    l = (lw - top).exp().sum(-1)  # the centroid terms' part of the denominator, relative to e^m
    acc = split_matmul((lc - top).exp(), cent_vsum.float())  # [B, Hkv, G, D]: of the numerator
    out = sparse_decode_attention(q.reshape(B, Hq, D).contiguous(), k, v, idx, count,
                                  extra=(m.reshape(B, Hq), l.reshape(B, Hq), acc.reshape(B, Hq, D)))
    return out.view(B, Hq, 1, D)


def split_matmul(w: torch.Tensor, x: torch.Tensor, programs: int = 256) -> torch.Tensor:
    """w [..., G, C] @ x [..., C, D] for a few rows G and many clusters C, split over n chunks of C (each chunk one
    batch entry of the product, the chunks' results summed), n the largest power of two dividing C that brings the
    batch entries up to about `programs`. Few batch entries (one row's KV heads) otherwise run as a few long
    programs: 0.55 ms for one layer at 128k x 1 on the H200, 0.04 ms split. Shapes only: graph-safe."""
    C = w.shape[-1]
    want = -(-programs // max(1, w.shape[:-2].numel()))
    n = 1
    while n * 2 <= want and C % (n * 2) == 0:
        n *= 2
    if n == 1:
        return w @ x
    parts = w.unflatten(-1, (n, C // n)).transpose(-3, -2) @ x.unflatten(-2, (n, C // n))  # [..., n, G, D]
    return parts.sum(-3)


def cluster_variance(key_sum: torch.Tensor, key_sq_sum: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """Per-dimension variance of each cluster's keys [..., C, D] fp32 from its sums and sizes [..., C] (empty: 0);
    elementwise, so the rows of one cluster come out the same computed alone or with the rest."""
    n = size.clamp_min(1)[..., None].float()
    return (key_sq_sum / n - (key_sum / n).square()).clamp_min(0)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, Hkv, S, D], idx [B, Hkv, M] -> [B, Hkv, M, D]."""
    return x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))


# ---------------------------------------------------------------------------------------------- the policy

@dataclass
class DoublePState:
    centroids: torch.Tensor  # [B, Hkv, C, D] (index_dtype): each cluster's mean key (the last one when it empties)
    key_sum: torch.Tensor  # [B, Hkv, C, D] fp32
    key_sq_sum: torch.Tensor  # [B, Hkv, C, D] fp32: Σ k² per dimension (the spread estimate's variances)
    value_sum: torch.Tensor  # [B, Hkv, C, D] fp32
    value_mean: torch.Tensor  # [B, Hkv, C, D] (index_dtype): value_sum / size (0 when empty), what the CUDA step reads
    size: torch.Tensor  # [B, Hkv, C] int64; 0: empty, or padding past the row's cluster count
    perm: torch.Tensor  # [B, Hkv, N] int64: the prefill members' slots grouped by cluster
    offsets: torch.Tensor  # [B, Hkv, C + 1] int64: cluster i's prefill members are perm[offsets[i]:offsets[i+1]]
    member_cluster: torch.Tensor  # [B, Hkv, N] int32: the cluster of each perm entry (C: padding past the row's)
    members: torch.Tensor  # [B, Hkv, C] int32: each cluster's prefill (CSR) member count, what the exact cap counts
    assign: torch.Tensor  # [B, Hkv, capacity] int64: each clustered slot's cluster, -1 elsewhere
    prefill_end: list[int]  # row b's prefill members are slots [sinks, prefill_end[b])
    clustered_end: list[int]  # row b's clustered slots are [sinks, clustered_end[b]); later slots are kept exact
    csr_end: list[int]  # perm/offsets are valid for slots below csr_end[b] (a rollback lowers it); clustered slots
    #                     from csr_end[b] on are found through `assign`
    # the same on the device [B] int64, which fixed-width steps read and advance (the lists follow on any eager call)
    clustered_end_dev: torch.Tensor | None = None
    csr_end_dev: torch.Tensor | None = None
    # estimate="spread": each cluster's per-dimension key variance [B, Hkv, C, D] (index_dtype), kept
    # current wherever the sums change, so a step reads it instead of recomputing it from three tensors
    spread: torch.Tensor | None = None

    def sync_ends(self, from_device: bool) -> None:
        """Fixed-width steps advance clustered_end on the device; eager code works on the lists."""
        if from_device:
            self.clustered_end = self.clustered_end_dev.tolist()
        elif self.clustered_end_dev is None:
            self.clustered_end_dev = device_ints(self.clustered_end, self.size.device)
            self.csr_end_dev = device_ints(self.csr_end, self.size.device)
        else:  # in place: a captured graph reads these tensors
            self.clustered_end_dev.copy_(device_ints(self.clustered_end, self.size.device))
            self.csr_end_dev.copy_(device_ints(self.csr_end, self.size.device))


@dataclass
class DoublePFixed:
    """The static buffers and widths of fixed-width steps (`DoubleP.plan_fixed`): a CUDA graph holds them."""

    positions: torch.Tensor  # [B] int64: each row's query position this step
    attended: torch.Tensor  # [B] fp32: keys attended per KV head (exact tokens + centroid terms), summed over layers
    kept_width: int  # sinks + the unclustered tail up to the query
    decoded_width: int  # clustered slots past the CSR lists (decoded tokens that joined clusters)
    exact_cap: int  # CSR members attended exactly
    candidates: torch.Tensor  # [B] bool: rows whose prefill left keys to cluster (the others keep decoded tokens exact)


@dataclass
class DoublePPlan:
    """One decode step's selection."""

    slots: torch.Tensor  # [B, Hkv, M] int64: slots attended exactly (kept tokens, then exact clusters' members)
    valid: torch.Tensor  # [B, Hkv, M] bool
    logits: torch.Tensor  # [B, Hkv, G, C] fp32: x_i
    kept_mass: torch.Tensor  # [B, Hkv] fp32: estimated mass of the always-kept tokens
    mass: torch.Tensor  # [B, Hkv, C] fp32: estimated cluster masses Â_i (query-group mean)
    in_p1: torch.Tensor  # [B, Hkv, C] bool
    exact: torch.Tensor  # [B, Hkv, C] bool: attended token by token (⊆ in_p1)
    approx: torch.Tensor  # [B, Hkv, C] bool: centroid terms (⊆ in_p1 \ exact)


class DoubleP(Policy):
    name = "doublep"
    Options = DoublePOptions
    graphable = True  # fixed-width steps (`plan_fixed`) with decoded = assign or window; recluster steps eagerly
    row_index = False  # one row's index has its own cluster and member counts: no `build_row` into a batch's

    def __init__(self, options: DoublePOptions | None = None):
        super().__init__(options)
        self.last_stats: dict[str, torch.Tensor] | None = None
        if self.options.decoded == "recluster":
            self.graphable = False  # its re-clustering sizes tensors on the host

    @property
    def target_mass(self) -> float:
        return self.options.p1

    def index_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the centroids and variances (`index_dtype`; auto: bf16 where the Triton kernels run)."""
        name = self.options.index_dtype
        if name == "auto":
            return torch.bfloat16 if triton_ready(device) else torch.float32
        return getattr(torch, name)

    def kmeans_dot(self, device: torch.device) -> str:
        """The k-means distances' precision (`kmeans_dot`; auto: bf16 where the Triton kernels run)."""
        name = self.options.kmeans_dot
        if name == "auto":
            return "bf16" if triton_ready(device) else "ieee"
        return name

    def build(self, layer, cache, lengths):
        if not self.is_sparse(layer):
            return
        o = self.options
        k, v = cache.k[layer], cache.v[layer]  # [B, Hkv, capacity, D]
        B, Hkv, capacity, D = k.shape
        ends = [max(o.sinks, n - o.window) for n in lengths]
        counts = [e - o.sinks for e in ends]  # candidates per row: slots [sinks, end)
        ks = [-(-n // o.cluster_size) for n in counts]
        C, N = max(1, *ks), max(1, *counts)
        dev, long = k.device, torch.long
        idt = self.index_dtype(dev)
        st = DoublePState(centroids=torch.zeros(B, Hkv, C, D, device=dev, dtype=idt),
                          key_sum=torch.zeros(B, Hkv, C, D, device=dev),
                          key_sq_sum=torch.zeros(B, Hkv, C, D, device=dev),
                          value_sum=torch.zeros(B, Hkv, C, D, device=dev),
                          value_mean=torch.zeros(B, Hkv, C, D, device=dev, dtype=idt),
                          size=torch.zeros(B, Hkv, C, dtype=long, device=dev),
                          perm=torch.zeros(B, Hkv, N, dtype=long, device=dev),
                          member_cluster=torch.full((B, Hkv, N), C, dtype=torch.int32, device=dev),
                          members=torch.zeros(B, Hkv, C, dtype=torch.int32, device=dev),
                          offsets=torch.zeros(B, Hkv, C + 1, dtype=long, device=dev),
                          assign=torch.full((B, Hkv, capacity), -1, dtype=long, device=dev),
                          prefill_end=ends, clustered_end=list(ends), csr_end=list(ends))
        cache.policy_state[layer] = st
        st.sync_ends(from_device=False)
        if o.estimate == "spread":
            st.spread = torch.zeros(B, Hkv, C, D, device=dev, dtype=idt)
        if max(counts) == 0:
            return
        # every row and KV head in one batched k-means: G = B * Hkv entries, row b's first counts[b] slots valid
        keys = k[:, :, o.sinks:o.sinks + N].reshape(B * Hkv, N, D)
        valid = (torch.arange(N, device=dev) < device_ints(counts, dev)[:, None])  # [B, N]
        valid = valid[:, None].expand(-1, Hkv, -1).reshape(B * Hkv, N)
        per_entry = device_ints(ks, dev).repeat_interleave(Hkv)  # [G]
        # each row's starts drawn as if it were alone: its own generator (seeded by layer), its own point count
        draws = torch.zeros(B, Hkv, N, device=dev)
        for b, count in enumerate(counts):
            gen = torch.Generator(device=dev).manual_seed(o.seed * 1_000_003 + layer)
            draws[b, :, :count] = torch.rand(Hkv, count, generator=gen, device=dev)
        centroids, assign = kmeans(keys, C, o.kmeans_iters, None, valid, per_entry, self.kmeans_dot(dev),
                                   draws.view(B * Hkv, N), o.kmeans_sample)  # [G, C, D], [G, N]
        key_sum, size = cluster_sums(keys, assign, C, valid)
        mean = key_sum / size.clamp_min(1)[..., None]
        shape = (B, Hkv, C)
        st.centroids = torch.where(size[..., None] > 0, mean, centroids).view(*shape, D).to(idt)
        st.key_sum, st.size = key_sum.view(*shape, D), size.view(shape)
        st.value_sum = cluster_sums(v[:, :, o.sinks:o.sinks + N].reshape(B * Hkv, N, D), assign, C, valid)[0] \
            .view(*shape, D)
        st.value_mean = (st.value_sum / st.size.clamp_min(1)[..., None]).to(idt)
        st.key_sq_sum = cluster_sums(keys.float().square(), assign, C, valid)[0].view(*shape, D)
        if o.estimate == "spread":
            st.spread = cluster_variance(st.key_sum, st.key_sq_sum, st.size).to(idt)
        member = torch.where(valid, assign, C)  # [G, N]: the row's candidates by cluster, padding last
        grouped = member.sort(dim=-1, stable=True)
        st.perm[..., :N] = (grouped.indices + o.sinks).view(B, Hkv, N)
        st.member_cluster[..., :N] = grouped.values.view(B, Hkv, N).int()
        st.offsets[..., 1:] = st.size.cumsum(-1)
        st.members = st.size.int()
        st.assign[..., o.sinks:o.sinks + N] = torch.where(valid, assign, -1).view(B, Hkv, N)

    def append(self, layer, cache, lengths):
        st: DoublePState | None = cache.policy_state[layer]
        if st is None:
            return
        o = self.options
        if self.fixed is not None:
            st.sync_ends(from_device=True)  # fixed-width steps clustered the tokens that left the window
        for b, n in enumerate(lengths):
            target = max(o.sinks, n - o.window)
            if o.decoded == "window" or st.prefill_end[b] == o.sinks:
                target = min(target, st.prefill_end[b])
            end = st.clustered_end[b]
            if target != end:
                lo, hi = min(target, end), max(target, end)
                keys, values = cache.k[layer][b, :, lo:hi].float(), cache.v[layer][b, :, lo:hi].float()
                if target > end:  # tokens left the window: join their nearest non-empty cluster
                    idx = nearest(keys, st.centroids[b], st.size[b] > 0)  # [Hkv, hi - lo]
                    st.assign[b, :, lo:hi] = idx
                    self._accumulate(st, b, idx, keys, values, 1)
                else:  # rollback: take the tokens past the new boundary out again
                    idx = st.assign[b, :, lo:hi].clone()
                    st.assign[b, :, lo:hi] = -1
                    self._accumulate(st, b, idx, keys, values, -1)
            st.clustered_end[b] = target
            st.csr_end[b] = min(st.csr_end[b], target)
        st.sync_ends(from_device=False)
        if o.decoded == "recluster" and any(e - p >= o.recluster_every
                                            for e, p in zip(st.clustered_end, st.prefill_end)):
            self.build(layer, cache, lengths)

    @staticmethod
    def _accumulate(st: DoublePState, row: int, idx: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    sign: int) -> None:
        """Add (sign 1) or remove (-1) tokens keys/values [Hkv, n, D] to/from clusters idx [Hkv, n] of `row`;
        their clusters' centroids become the new means."""
        at = idx[..., None].expand(-1, -1, keys.shape[-1])
        st.key_sum[row].scatter_add_(1, at, sign * keys)
        st.key_sq_sum[row].scatter_add_(1, at, sign * keys.square())
        st.value_sum[row].scatter_add_(1, at, sign * values)
        st.size[row].scatter_add_(1, idx, torch.full_like(idx, sign))
        size = st.size[row].gather(1, idx)[..., None]  # [Hkv, n, 1]
        mean = st.key_sum[row].gather(1, at) / size.clamp_min(1)
        st.centroids[row].scatter_(1, at, torch.where(size > 0, mean, st.centroids[row].gather(1, at).float())
                                   .to(st.centroids.dtype))
        st.value_mean[row].scatter_(1, at, (st.value_sum[row].gather(1, at) / size.clamp_min(1))
                                    .to(st.value_mean.dtype))
        if st.spread is not None:
            st.spread[row] = cluster_variance(st.key_sum[row], st.key_sq_sum[row], st.size[row]).to(st.spread.dtype)

    def plan(self, layer: int, q: torch.Tensor, cache: KVCache, positions: torch.Tensor) -> DoublePPlan:
        """q [B, Hq, 1, D] at `positions` [B] -> this step's cluster sets and exactly attended slots (widths from
        the host's positions and ends: every exact cluster's members, no cap)."""
        st: DoublePState | None = cache.policy_state[layer]
        if st is None:
            raise SparseSpecError(f"doublep has no index for layer {layer}: build it at the end of prefill")
        pos, ends, pre = self.host_positions(positions), st.clustered_end, st.csr_end
        kept = max(min(self.options.sinks, p + 1) + max(0, p - e + 1) for p, e in zip(pos, ends))
        decoded = max(max(0, e - s) for e, s in zip(ends, pre))
        return self.select(st, q, cache.k[layer], device_ints(pos, q.device), st.clustered_end_dev, st.csr_end_dev,
                           kept, decoded, None)

    def select(self, st: DoublePState, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               clustered_end: torch.Tensor, csr_end: torch.Tensor, kept_width: int, decoded_width: int,
               cap: int | None) -> DoublePPlan:
        """Stage 1, stage 2 and the exactly attended slots from device tensors alone (positions, clustered_end,
        csr_end [B]) over the given widths, which must cover the step: the kept tail, the decoded clustered slots
        and, with `cap`, the exact clusters' CSR members (past it the lowest-ranked exact clusters become centroid
        terms; None: every member, their count read back)."""
        o = self.options
        B, Hq, _, D = q.shape
        Hkv, dev = k.shape[1], q.device
        qg = q.reshape(B, Hkv, Hq // Hkv, D).float()
        ends, pre = clustered_end[:, None], csr_end[:, None]  # [B, 1]

        # Always kept: sinks [0, min(sinks, pos + 1)) and [clustered_end, pos].
        kept, kept_valid = kept_slots(positions, clustered_end, o.sinks, kept_width, Hkv)  # [B, Hkv, W]
        kept_logits = (qg @ _gather(k, kept).float().transpose(-1, -2)) * D**-0.5  # [B, Hkv, G, W]

        # Stage 1 and stage 2 on cluster masses.
        logits, ranked = self._cluster_logits(st, qg)
        cvalid = st.size > 0
        kept_mass, mass = estimate_masses(kept_logits, kept_valid, ranked, st.size.float().log(), cvalid)
        in_p1, wanted, exact = select_clusters(mass, cvalid, kept_mass, o.p1, o.p2, o.p2_of == "selected",
                                               st.members, cap)
        approx = in_p1 & ~exact if o.tail == "approx" else wanted & ~exact  # capped clusters stay as centroids

        # Exact clusters' members: prefill members via CSR (below csr_end), the later clustered slots
        # [csr_end, clustered_end) through their recorded cluster.
        members, members_valid = csr_members(st.perm, st.offsets, exact, cap)
        members_valid &= members < pre[..., None]
        d = torch.arange(decoded_width, device=dev)
        dec_valid = (d < (ends - pre).clamp_min(0))[:, None].expand(-1, Hkv, -1)  # [B, Hkv, W2]
        dec = (pre + d)[:, None].expand(-1, Hkv, -1).masked_fill(~dec_valid, 0)
        cluster = st.assign.gather(-1, dec)
        dec_valid = dec_valid & (cluster >= 0) & exact.gather(-1, cluster.clamp_min(0))
        return DoublePPlan(slots=torch.cat([kept, dec.masked_fill(~dec_valid, 0), members], -1),
                           valid=torch.cat([kept_valid, dec_valid, members_valid], -1), logits=logits,
                           kept_mass=kept_mass, mass=mass, in_p1=in_p1, exact=exact, approx=approx)

    def decode_with_stats(self, layer, q, cache, positions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (output [B, Hq, 1, D], stats): per (row, KV head) [B, Hkv]: exact_tokens (tokens attended exactly,
        kept ones included), centroid_terms, clusters (non-empty), p1_clusters, exact_clusters, and the estimated
        masses p1_mass (kept + p1 set) and exact_mass (kept + exact clusters)."""
        st: DoublePState = cache.policy_state[layer]
        plan = self.plan(layer, q, cache, positions)
        out = self.attend(st, q, cache, layer, plan)
        stats = {"exact_tokens": plan.valid.sum(-1), "centroid_terms": plan.approx.sum(-1),
                 "clusters": (st.size > 0).sum(-1), "p1_clusters": plan.in_p1.sum(-1),
                 "exact_clusters": plan.exact.sum(-1), "p1_mass": plan.kept_mass + (plan.mass * plan.in_p1).sum(-1),
                 "exact_mass": plan.kept_mass + (plan.mass * plan.exact).sum(-1)}
        return out, stats

    def decode(self, layer, q, cache, positions):
        if self.fixed is not None:
            return self.decode_fixed(layer, q, cache)
        out, self.last_stats = self.decode_with_stats(layer, q, cache, positions)
        self.count_attended(self.last_stats["exact_tokens"] + self.last_stats["centroid_terms"])
        return out

    # ------------------------------------------------------------------------------------ fixed-width steps

    def plan_fixed(self, cache: KVCache, lengths: list[int]) -> None:
        """After `build`: static widths and buffers for fixed-width steps over this cache (no host reads in a step:
        a CUDA graph can capture every sparse layer). The kept tail, the decoded members and the exact CSR members
        each get a width that covers every step up to the capacity; only the last is capped (`exact_cap`)."""
        o = self.options
        S, B = cache.capacity, cache.batch
        states = [st for st in cache.policy_state if isinstance(st, DoublePState)]
        prefill = min((min(st.prefill_end) for st in states), default=o.sinks)
        csr = min((min(st.csr_end) for st in states), default=o.sinks)
        grows = o.decoded == "window" or any(e <= o.sinks for st in states for e in st.prefill_end)
        members = max((st.perm.shape[-1] for st in states), default=1)
        cap = max(o.min_tokens, round(o.exact_cap * S) if o.exact_cap <= 1 else int(o.exact_cap))
        self.fixed = DoublePFixed(
            positions=torch.zeros(B, dtype=torch.long, device=cache.device),
            attended=torch.zeros(B, device=cache.device),
            kept_width=min(S, o.sinks + (S - prefill if grows else o.window + 1)),
            decoded_width=0 if o.decoded == "window" else max(0, S - csr),
            exact_cap=members if o.p2 >= 1 else max(1, min(members, cap)),
            candidates=device_ints([int(e > o.sinks) for e in (states[0].prefill_end if states else [0] * B)],
                                   cache.device).bool())

    def begin_step(self, positions: torch.Tensor) -> None:
        self.fixed.positions.copy_(positions)

    def decode_fixed(self, layer: int, q: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One sparse layer of a fixed-width step: the token leaving the window joins its nearest cluster
        (decoded="assign"), then the plan and the merged attention of `decode`, over static widths."""
        st: DoublePState = cache.policy_state[layer]
        fx = self.fixed
        if triton_ready(q.device) and self.options.p2_of == "total":
            return self._decode_kernels(st, q, cache, layer)
        if self.options.decoded == "assign":
            self._cluster_leaving(st, cache, layer, fx.positions)
        plan = self.select(st, q, cache.k[layer], fx.positions, st.clustered_end_dev, st.csr_end_dev,
                           fx.kept_width, fx.decoded_width, fx.exact_cap)
        out = self.attend(st, q, cache, layer, plan)
        fx.attended.add_((plan.valid.sum(-1) + plan.approx.sum(-1)).float().mean(-1))
        return out

    def _decode_kernels(self, st: DoublePState, q: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """`decode_fixed` through the kernels, for p2_of="total" on CUDA: the leaving key's join measured in the
        scoring pass (`kernels/clusters.py`), the sort-free selection (`kernels/cluster_select.py`: masses of one
        class are taken together, else the sets of `select`) and the merged softmax."""
        from ..kernels.attend import sparse_decode_attention
        from ..kernels.cluster_select import APPROX, append_exact_members, cluster_masses, kept_tokens, mark_clusters
        from ..kernels.clusters import Leaving, cluster_scores, cluster_scores_nearest, join_leaving

        o, fx = self.options, self.fixed
        k, v = cache.k[layer], cache.v[layer]
        B, Hq, _, D = q.shape
        Hkv, C = k.shape[1], st.size.shape[-1]
        G, R = Hq // Hkv, B * Hkv
        qf = q.reshape(B, Hq, D).contiguous()
        qg, spread = qf.view(B, Hkv, G, D), st.spread  # (None but with estimate="spread")
        if o.decoded == "assign":  # scores [B, Hkv, G, C] of the index after the leaving key joined its cluster
            leaving = Leaving(k, fx.positions, st.clustered_end_dev, fx.candidates, st.size, o.window, o.sinks)
            logits, ranked, nearest = cluster_scores_nearest(qg, st.centroids, spread, leaving)
            join_leaving(k, v, fx.positions, st.clustered_end_dev, fx.candidates, st.centroids, st.key_sum,
                         st.key_sq_sum, st.value_sum, st.value_mean, st.size, st.spread, st.assign, o.window, o.sinks,
                         nearest=nearest, scores=(qg, logits, ranked))
        else:
            logits, ranked = cluster_scores(qg, st.centroids, spread)
        # the slot list: the kept tokens first, then the exact clusters' members and decoded slots
        width = fx.kept_width + fx.decoded_width + fx.exact_cap
        idx = torch.empty(R, width, dtype=torch.int32, device=q.device)
        kept_logits, count = kept_tokens(qf, k, fx.positions, st.clustered_end_dev, o.sinks, fx.kept_width, idx)
        mass, _, thr = cluster_masses(ranked.view(R, G, C), st.size.view(R, C), st.members.view(R, C), kept_logits,
                                      o.p1, o.p2, fx.exact_cap)
        flags, (cm, cl, cacc) = mark_clusters(mass, thr, st.size.view(R, C), logits.view(R, G, C),
                                              st.value_mean.view(R, C, D), o.tail == "approx")
        count = append_exact_members(st.perm.view(R, -1), st.member_cluster.view(R, -1), flags, st.csr_end_dev, idx,
                                     count, st.assign.view(R, -1), st.clustered_end_dev, fx.decoded_width)
        out = sparse_decode_attention(qf, k, v, idx.view(B, Hkv, width), count.view(B, Hkv),
                                      extra=(cm.view(B, Hq), cl.view(B, Hq), cacc.view(B, Hq, D)))
        approx = ((flags & APPROX) != 0).sum(-1).view(B, Hkv)
        fx.attended.add_((count.view(B, Hkv) + approx).float().mean(-1))
        return out.view(B, Hq, 1, D)

    @staticmethod
    def attend(st: DoublePState, q: torch.Tensor, cache: KVCache, layer: int, plan: DoublePPlan) -> torch.Tensor:
        """The plan's merged softmax -> [B, Hq, 1, D]: through the Triton sparse attention on CUDA
        (`merged_attention_sparse`), through `merged_attention` (its reference) elsewhere."""
        B, Hq, _, _ = q.shape
        k, v = cache.k[layer], cache.v[layer]
        cent = (plan.logits.reshape(B, Hq, -1), st.size.float().log(), st.value_sum, plan.approx)
        if triton_ready(q.device):
            return merged_attention_sparse(q, k, v, plan.slots, plan.valid, *cent)
        return merged_attention(q, _gather(k, plan.slots), _gather(v, plan.slots), plan.valid, *cent)

    def _cluster_leaving(self, st: DoublePState, cache: KVCache, layer: int, positions: torch.Tensor) -> None:
        """Before a step at positions [B]: the slot that left the window since the last step joins its nearest
        non-empty cluster (what `append` does after a step, for one token a row), on the device. A jump (a graph's
        warm-up step at the last slot) clusters nothing: multi-token commits and rollbacks go through `append`."""
        from ..kernels.clusters import join_leaving, join_leaving_ref

        join = join_leaving if triton_ready(positions.device) else join_leaving_ref
        join(cache.k[layer], cache.v[layer], positions, st.clustered_end_dev, self.fixed.candidates, st.centroids,
             st.key_sum, st.key_sq_sum, st.value_sum, st.value_mean, st.size, st.spread, st.assign,
             self.options.window, self.options.sinks)

    def _cluster_logits(self, st: DoublePState, qg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qg [B, Hkv, G, D] fp32 -> (x_i [B, Hkv, G, C], the log-mass the selection ranks by: x_i, plus the
        spread term with estimate="spread")."""
        from ..kernels.clusters import cluster_scores, cluster_scores_ref

        # (st.spread is None but with estimate="spread")
        return (cluster_scores if triton_ready(qg.device) else cluster_scores_ref)(qg, st.centroids, st.spread)

    def selected_slots(self, layer: int, q: torch.Tensor, cache: KVCache,
                       positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (exact [B, Hkv, S], approximated [B, Hkv, S]) bool, S = max(positions) + 1: the slots attended token
        by token, and the members of the clusters entering as centroid terms (disjoint)."""
        st: DoublePState = cache.policy_state[layer]
        plan = self.plan(layer, q, cache, positions)
        S = max(self.host_positions(positions)) + 1
        B, Hkv, _ = plan.slots.shape
        hits = torch.zeros(B, Hkv, S, dtype=torch.long, device=q.device)
        exact = hits.scatter_add_(-1, plan.slots, plan.valid.long()) > 0
        cluster = st.assign[..., :S]
        approx = (cluster >= 0) & plan.approx.gather(-1, cluster.clamp_min(0))
        return exact, approx
