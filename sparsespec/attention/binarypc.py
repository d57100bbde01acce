"""BinaryPC: training-free hashing sparse attention from binary principal components of the keys.

Per (row, layer, KV head) a real basis P [b, D] and binary codes H in {±1}^{N x b} are fitted greedily so that
K ≈ H P (one bit at a time, alternating u = sign(R v), v = Rᵀu / N, then deflating R). Keys are encoded
residually, packed into 64-bit words, and a decode query scores them with its probe p = q Pᵀ quantised to signed
7-bit integers: score(k) = Σ_i p̃_i h_i, computed with popcounts over the packed codes. The group score of a KV
head is the max over its query heads; the top (budget) keys get exact attention. An error-aware safeguard always
selects the keys the codes describe worst.

    fit_basis -> encode -> pack_bits          (build, end of prefill)
    quantize_probe -> packed_scores -> max    (decode)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SparseSpecError
from .policy import BudgetOptions, SelectKeys, SelectionPolicy, device_ints, group_max, option, selection_mask

WORD = 64


@dataclass(frozen=True)
class BinaryPCOptions(BudgetOptions):
    bits: int = option(64, "code width: bits of each key's binary code")
    iters: int = option(4, "alternating fitting steps per bit (the paper: 4 online, 8 offline)")
    seed: int = option(0, "seed of the basis fit's random starts")
    safeguard: float = option(0.1, "share of the budget kept for the keys with the largest reconstruction error")
    probe_bits: int = option(7, "magnitude bits of the quantised query probe")
    encode_decoded: bool = option(False, "hash decoded tokens once they leave the recent window (bounded budget; "
                                         "false: they are all attended)")
    basis: str = option("", "a calibrated basis file (`sparsespec calibrate binarypc`); empty: fit on each prompt")
    fit_tokens: int = option(8192, "fit the basis on at most this many keys per head, evenly spaced (0: every key)")
    scorer: str = option("auto", "the GPU step's scorer: `dp4a` (byte dot products in registers; probe_bits <= 7), "
                                  "`tables` (byte tables in shared memory) or `auto` (dp4a where the probe fits, "
                                  "else tables); the same keys but where a probe level lies on a rounding boundary")

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.bits <= 1024:
            raise SparseSpecError(f"bits must be in [1, 1024], got {self.bits}")
        if self.iters < 1:
            raise SparseSpecError(f"iters must be >= 1, got {self.iters}")
        if not 0 <= self.safeguard < 1:
            raise SparseSpecError(f"safeguard must be in [0, 1), got {self.safeguard}")
        if not 1 <= self.probe_bits <= 30:
            raise SparseSpecError(f"probe_bits must be in [1, 30], got {self.probe_bits}")
        if self.fit_tokens < 0:
            raise SparseSpecError(f"fit_tokens must be >= 0, got {self.fit_tokens}")
        if self.scorer not in ("auto", "dp4a", "tables"):
            raise SparseSpecError(f"scorer must be auto, dp4a or tables, got {self.scorer!r}")
        if self.scorer == "dp4a" and self.probe_bits > 7:
            raise SparseSpecError(f"scorer dp4a multiplies signed bytes: probe_bits must be <= 7, got "
                                  f"{self.probe_bits}")
        if self.basis and not Path(self.basis).is_file():
            raise SparseSpecError(f"basis file {self.basis} not found")


# ---------------------------------------------------------------------------------------------- fitting, encoding

def fit_basis(keys: torch.Tensor, bits: int, iters: int, generator: torch.Generator,
              counts: list[int] | None = None, graphs: dict | None = None) -> torch.Tensor:
    """keys [..., G, N, D] (independent heads; the leading dims, e.g. rows, share the random starts of their G
    heads) -> basis P [..., G, bits, D] fp32, fitted greedily one bit at a time. `counts` (one per leading index,
    keys [R, G, N, D]): only the first counts[r] keys of index r are fitted, the rest is padding. `graphs` (CUDA):
    a dict in which the fit's CUDA graph is kept per shape and replayed (the same kernels, one launch instead of
    bits x iters x ~6; every layer of a build shares one)."""
    *_, G, N, D = keys.shape
    residual = keys.float().clone()
    keep: torch.Tensor | None = None
    if counts is not None:
        n = torch.tensor(counts, dtype=torch.float32, device=keys.device).view(-1, 1, 1, 1)
        keep = (torch.arange(N, device=keys.device) < n).float().transpose(-1, -2)  # [R, 1, N, 1]
        residual *= keep
    starts = torch.randn(bits, G, D, 1, generator=generator).to(keys.device)  # one copy to the device, not one a bit
    if graphs is None or keys.device.type != "cuda":
        return _fit(residual, starts, keep, iters)
    shape = (tuple(residual.shape), bits, iters, keep is not None)
    if shape not in graphs:
        graphs[shape] = _FitGraph(residual, starts, keep, iters)
    return graphs[shape](residual, starts, keep)


def _fit(residual: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor | None, iters: int) -> torch.Tensor:
    """The greedy fit on device tensors alone (capturable): residual [..., G, N, D] fp32 (padding zeroed; updated
    in place), starts [bits, G, D, 1], keep [R, 1, N, 1] or None -> basis [..., G, bits, D]."""
    *lead, G, N, D = residual.shape
    bits = starts.shape[0]
    n = N if keep is None else keep.sum(-2, keepdim=True).clamp_min(1)  # [R, 1, 1, 1]
    basis = torch.empty(*lead, G, bits, D, device=residual.device)
    for i in range(bits):
        v = starts[i] / starts[i].norm(dim=-2, keepdim=True)
        for _ in range(iters):
            u = _sign(residual @ v)  # [..., G, N, 1]
            if keep is not None:
                u = u * keep  # padding stays zero
            v = residual.transpose(-1, -2) @ u / n  # [..., G, D, 1]: least squares for fixed u
        residual -= u * v.transpose(-1, -2)
        basis[..., i, :] = v.squeeze(-1)
    return basis


class _FitGraph:
    """`_fit` captured once for a shape (after a warm-up on a side stream), then replayed on copied inputs."""

    def __init__(self, residual: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor | None, iters: int):
        self.residual, self.starts = residual.clone(), starts.clone()
        self.keep = None if keep is None else keep.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # cuBLAS sets itself up outside the capture
            _fit(residual.clone(), starts, keep, iters)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.basis = _fit(self.residual, self.starts, self.keep, iters)  # updates self.residual when replayed

    def __call__(self, residual: torch.Tensor, starts: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        self.residual.copy_(residual)
        self.starts.copy_(starts)
        if keep is not None:
            self.keep.copy_(keep)
        self.graph.replay()
        return self.basis.clone()


def encode(keys: torch.Tensor, basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., G, N, D], basis [..., G, b, D] -> (signs [..., G, N, b] bool, True = +1; reconstruction error
    ‖k − hP‖ [..., G, N]). Residual encoding: h_i = sign(r · P_i), then r -= h_i P_i."""
    residual = keys.float().clone()
    signs = torch.empty(*keys.shape[:-1], basis.shape[-2], dtype=torch.bool, device=keys.device)
    for i in range(basis.shape[-2]):
        p = basis[..., i, None, :]  # [..., G, 1, D]
        h = _sign((residual * p).sum(-1, keepdim=True))  # [..., G, N, 1]
        residual -= h * p
        signs[..., i] = h.squeeze(-1) > 0
    return signs, residual.norm(dim=-1)


def _sign(x: torch.Tensor) -> torch.Tensor:
    """±1 with sign(0) = +1."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


# ---------------------------------------------------------------------------------------------- packing, scoring

def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool [..., b] -> int64 [..., ceil(b / 64)]: bit i goes to word i // 64, position i % 64."""
    b = bits.shape[-1]
    words = -(-b // WORD)
    padded = torch.zeros(*bits.shape[:-1], words * WORD, dtype=torch.int64, device=bits.device)
    padded[..., :b] = bits.long()
    shifts = torch.arange(WORD, device=bits.device)
    # the shifted bits are disjoint, so their sum is their OR (no carry, bit 63 included)
    return (padded.view(*bits.shape[:-1], words, WORD) << shifts).sum(-1)


def unpack_bits(codes: torch.Tensor, b: int) -> torch.Tensor:
    """int64 [..., W] -> bool [..., b] (inverse of pack_bits)."""
    shifts = torch.arange(WORD, device=codes.device)
    bits = (codes[..., None] >> shifts) & 1  # [..., W, 64]
    return bits.flatten(-2)[..., :b].bool()


_M1, _M2, _M4, _H01 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F, 0x0101010101010101


def popcount(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 (SWAR). The masks clear every bit where an arithmetic shift differs from a
    logical one, so negative words count right too."""
    x = x - ((x >> 1) & _M1)
    x = (x & _M2) + ((x >> 2) & _M2)
    x = (x + (x >> 4)) & _M4
    return (x * _H01) >> 56


def quantize_probe(probe: torch.Tensor, magnitude_bits: int) -> torch.Tensor:
    """probe [B, Hkv, G, b] -> signed integers in [−(2^m − 1), 2^m − 1], one scale per (row, KV head)."""
    top = (1 << magnitude_bits) - 1
    scale = probe.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-30)
    return torch.round(probe / scale * top).long()


def packed_scores(codes: torch.Tensor, probe: torch.Tensor, magnitude_bits: int) -> torch.Tensor:
    """Σ_i p̃_i h_i in integer arithmetic. codes [B, Hkv, S, W] int64, probe [B, Hkv, G, b] int64
    -> [B, Hkv, G, S] int64.

    With h_i = ±1 and p̃_i = s_i m_i: p̃_i h_i = m_i (1 − 2 x_i) where x_i = [h_i ≠ s_i] = code XOR sign-bits.
    Splitting m_i into bit-planes M_j: Σ = Σ_j 2^j (|M_j| − 2 popcount(M_j AND x))."""
    sign_words = pack_bits(probe >= 0)  # [B, Hkv, G, W]
    differ = codes[:, :, None] ^ sign_words[:, :, :, None]  # [B, Hkv, G, S, W]
    j = torch.arange(magnitude_bits, device=codes.device)[:, None]
    planes = pack_bits(((probe.abs()[..., None, :] >> j) & 1).bool())  # [B, Hkv, G, m, W]: M_j
    agree = popcount(planes).sum(-1)[..., None]  # [B, Hkv, G, m, 1]: |M_j|
    clash = popcount(planes[..., None, :] & differ[:, :, :, None]).sum(-1)  # [B, Hkv, G, m, S]
    return ((agree - 2 * clash) << j).sum(-2)


# ---------------------------------------------------------------------------------------------- the policy

PENDING = 16  # slots a fixed-width step encodes at most (one a plain decode step; a speculative commit more)


@dataclass
class BinaryPCState:
    basis: torch.Tensor  # [B, Hkv, b, D] fp32
    codes: torch.Tensor  # [B, Hkv, capacity, W] int64
    error: torch.Tensor  # [B, Hkv, capacity] fp32
    encoded: list[int]  # slots [0, encoded[b]) of row b hold valid codes (eager steps)
    encoded_dev: torch.Tensor  # [B] int32: the same on the device (fixed-width steps keep it there)
    safe: torch.Tensor  # [B, Hkv, n] int32: the slots encoded at build by decreasing reconstruction error


class BinaryPC(SelectionPolicy):
    name = "binarypc"
    Options = BinaryPCOptions

    def __init__(self, options: BinaryPCOptions | None = None):
        super().__init__(options)
        self.calibrated = load_basis(self.options.basis, self.options.bits) if self.options.basis else None
        self._fit_graphs: dict | None = None  # during `build_all`: the basis fit's CUDA graph per shape

    def build(self, layer, cache, lengths):
        if not self.is_sparse(layer):
            return
        opts = self.options
        k = cache.k[layer]  # [B, Hkv, S, D]
        B, Hkv, S, D = k.shape
        state = BinaryPCState(
            basis=torch.zeros(B, Hkv, opts.bits, D, device=k.device),  # rows without keys: no garbage
            codes=torch.zeros(B, Hkv, S, -(-opts.bits // WORD), dtype=torch.int64, device=k.device),
            error=torch.zeros(B, Hkv, S, device=k.device),
            encoded=list(lengths),
            encoded_dev=torch.tensor(lengths, dtype=torch.int32, device=k.device),
            safe=torch.zeros(B, Hkv, 0, dtype=torch.int32, device=k.device),  # set below
        )
        n = max(lengths)
        if self.calibrated is not None:
            state.basis[:] = self._calibrated_basis(layer, Hkv, D).to(k.device)
        elif n > 0:  # every row at once, each from the same random starts (as alone), shorter rows padded
            gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + layer)
            sample, counts = fit_sample(k, lengths, opts.fit_tokens)
            state.basis[:] = fit_basis(sample, opts.bits, opts.iters, gen, counts, self._fit_graphs)
        if n > 0:
            encode_range(k, state, torch.zeros_like(state.encoded_dev), state.encoded_dev, n)
        # the safeguard's candidates: the keys encoded now, worst described first (ties: lower slot); as many for
        # every build of this capacity (a row built alone fits the batch's list)
        slots = torch.arange(S, device=k.device)
        error = state.error.masked_fill(slots >= state.encoded_dev.view(B, 1, 1), float("-inf"))
        order = torch.sort(error, dim=-1, descending=True, stable=True).indices
        state.safe = order[..., :min(S, self._safeguarded([S - 1])[0])].int()
        cache.policy_state[layer] = state

    def build_all(self, cache, lengths):
        self._fit_graphs = {}  # every layer's fit replays one graph; dropped after (it holds the fit's buffers)
        try:
            super().build_all(cache, lengths)
        finally:
            self._fit_graphs = None

    def _calibrated_basis(self, layer: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        basis = self.calibrated.get(f"layer{layer}")
        if basis is None or basis.shape != (num_kv_heads, self.options.bits, head_dim):
            raise SparseSpecError(f"basis file {self.options.basis} does not fit this model at layer {layer} "
                                  f"(want [{num_kv_heads}, {self.options.bits}, {head_dim}])")
        return basis

    def append(self, layer, cache, lengths):
        state: BinaryPCState | None = cache.policy_state[layer]
        if state is None:
            return
        n = device_ints(lengths, state.encoded_dev.device, torch.int32)
        torch.minimum(state.encoded_dev, n, out=state.encoded_dev)  # a rollback forgets codes past the length
        state.encoded = [min(e, m) for e, m in zip(state.encoded, lengths)]
        if self.options.encode_decoded and self.fixed is None:
            # the next query sits at position n and forces the window (n - w, n]: hash everything before it
            end = [max(e, m - max(self.options.window, 1) + 1) for e, m in zip(state.encoded, lengths)]
            most = max(e - s for s, e in zip(state.encoded, end))
            if most > 0:
                end_dev = device_ints(end, n.device, torch.int32)
                encode_range(cache.k[layer], state, state.encoded_dev, end_dev, most)
                state.encoded = end
                state.encoded_dev.copy_(end_dev)

    def append_all(self, cache, lengths):
        states = [s for s in cache.policy_state if s is not None]
        if self.fixed is None or not states:
            super().append_all(cache, lengths)  # (eager steps may encode decoded tokens, layer by layer)
            return
        # fixed-width steps encode in their graphs: a rollback only forgets the codes past the lengths, every
        # layer's in one copy and one launch (a speculative loop rolls back twice a step)
        n = device_ints(lengths, states[0].encoded_dev.device, torch.int32)
        torch._foreach_minimum_([s.encoded_dev for s in states], [n] * len(states))
        for s in states:
            s.encoded = [min(e, m) for e, m in zip(s.encoded, lengths)]

    def _safeguarded(self, positions: list[int]) -> list[int]:
        """Per row, how many of the budget go to the worst-described keys."""
        return [int(self.options.safeguard * self.options.tokens(p + 1)) for p in positions]

    def extra_forced(self, capacity, lengths):
        return self._safeguarded([capacity - 1])[0] + capacity - min(lengths)  # the safeguard, the unhashed tail

    def scored_in(self, layer, cache, positions):
        # decoded tokens not hashed yet, and the safeguarded keys
        encoded = cache.policy_state[layer].encoded
        safe = self._safeguarded(positions) if self.options.safeguard > 0 else [0] * len(positions)
        return [max(0, p + 1 - e) + n for p, e, n in zip(positions, encoded, safe)]

    def scores(self, layer, q, cache, positions):
        state: BinaryPCState = cache.policy_state[layer]
        opts = self.options
        B, Hq, _, D = q.shape
        Hkv = state.basis.shape[1]
        kv_len = max(self.host_positions(positions)) + 1
        probe = q.view(B, Hkv, Hq // Hkv, D).float() @ state.basis.transpose(-1, -2)  # [B, Hkv, G, b]
        raw = packed_scores(state.codes[:, :, :kv_len], quantize_probe(probe, opts.probe_bits), opts.probe_bits)
        scores = group_max(raw.view(B, Hq, kv_len).float(), Hkv)  # [B, Hkv, S]
        slots = torch.arange(kv_len, device=q.device)
        encoded = device_ints(state.encoded, q.device).view(B, 1, 1)
        unencoded = slots >= encoded  # decoded tokens not hashed (yet): always attended
        if opts.safeguard > 0:
            n_safe = self._safeguarded(self.host_positions(positions))
            scores = scores.masked_fill(safeguard_mask(state.safe, n_safe, kv_len, cache.capacity), float("inf"))
        return scores.masked_fill(unencoded, float("inf"))

    def fixed_keys(self, layer, q, cache):
        from ..kernels import triton_ready
        from ..kernels import binarypc as kernels

        state: BinaryPCState = cache.policy_state[layer]
        opts, plan = self.options, self.fixed
        fast = triton_ready(q.device)
        if opts.encode_decoded:  # hash what left the window since the last step (at most PENDING slots)
            end = torch.maximum(state.encoded_dev, plan.positions - max(opts.window, 1) + 1)
            encode_range(cache.k[layer], state, state.encoded_dev, end, PENDING)
            state.encoded_dev.copy_(torch.minimum(end, state.encoded_dev + PENDING))
        B, Hq, _, D = q.shape
        Hkv = state.basis.shape[1]
        key_bits = kernels.key_range(opts.bits, opts.probe_bits)[1]
        samples = None
        if fast:  # the sampled slots' keys written beside the keys when the select samples them
            from ..kernels.select import takes_candidates

            S = state.codes.shape[2]  # (the width the step's select takes by default: `fixed_selection`)
            if takes_candidates(B * Hkv, S, plan.buffers(layer)[0].shape[1], key_bits):
                samples = kernels.sample_copy(B * Hkv, S, key_bits, q.device)
        dp4a = opts.scorer == "dp4a" or (opts.scorer == "auto" and opts.probe_bits <= 7)
        safe = opts.safeguard > 0
        # the safeguard's forced list: written by the scorer kernels with the keys (no launch of its own), by the
        # select on CPU
        extra = (state.safe.flatten(0, 1), plan.listed) if safe else None
        if fast and dp4a:  # the probe packed as bytes, four code bits a dp4a
            _, packed, sums = kernels.probe_packed(q.view(B, Hq, D), state.basis, opts.probe_bits)
            keys = kernels.score_keys_dp4a(state.codes, packed, sums, plan.positions, opts.probe_bits, opts.bits,
                                           samples=samples, extra=extra)
        elif fast:  # byte tables of the quantised probe, then one table read per code byte
            _, tables = kernels.probe_tables(q.view(B, Hq, D), state.basis, opts.probe_bits)
            keys = kernels.score_keys(state.codes, tables, plan.positions, opts.probe_bits, opts.bits, Hq // Hkv,
                                      samples=samples, extra=extra)
        else:
            probe = q.view(B, Hkv, Hq // Hkv, D).float() @ state.basis.transpose(-1, -2)  # [B, Hkv, G, b]
            keys = kernels.score_keys_ref(state.codes, quantize_probe(probe, opts.probe_bits).flatten(0, 1),
                                          plan.positions, opts.probe_bits, opts.bits)
            return SelectKeys(keys, key_bits, state.encoded_dev, *(extra or (None, None)), samples)
        return SelectKeys(keys, key_bits, state.encoded_dev, samples=samples)

    def listed_forced(self, tokens):
        # the safeguard: the worst-described keys, a share of the budget (once per step, for every layer)
        return (self.options.safeguard * tokens.double()).floor().int() if self.options.safeguard > 0 else None


def fit_sample(k: torch.Tensor, lengths: list[int], most: int) -> tuple[torch.Tensor, list[int]]:
    """k [B, Hkv, S, D] -> (at most `most` keys per row, evenly spaced over its first lengths[b] slots
    [B, Hkv, T, D], the count per row). most = 0: every key."""
    n = max(lengths)
    if most == 0 or n <= most:
        return k[:, :, :n], list(lengths)
    i = torch.arange(most, device=k.device)
    lens = torch.tensor(lengths, device=k.device)[:, None]  # [B, 1]
    slots = torch.where(lens > most, i * lens // most, i).clamp_max(k.shape[2] - 1)  # [B, T]
    sample = k.gather(2, slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3]))
    return sample, [min(m, most) for m in lengths]


def encode_range(k: torch.Tensor, state: BinaryPCState, start: torch.Tensor, end: torch.Tensor, most: int) -> None:
    """Encode the slots [start[b], end[b]) (at most `most` per row) into the state's codes and errors: the
    Triton kernel on CUDA, the reference on CPU."""
    from ..kernels import triton_ready
    from ..kernels.binarypc import encode_slots, encode_slots_ref

    (encode_slots if triton_ready(k.device) else encode_slots_ref)(k, state.basis, state.codes, state.error,
                                                                     start, end, most)


def safeguard_mask(safe: torch.Tensor, counts: list[int], kv_len: int, capacity: int) -> torch.Tensor:
    """safe [B, Hkv, n] (slots < capacity by decreasing error) -> bool [B, Hkv, kv_len]: the first counts[b]
    slots of row b's list."""
    B, _, n = safe.shape
    listed = torch.arange(n, device=safe.device) < device_ints(counts, safe.device).view(B, 1, 1)
    return selection_mask(safe.long(), listed, capacity)[..., :kv_len]


def fit_calibrated_basis(keys_per_layer: dict[int, torch.Tensor], bits: int, iters: int = 8,
                         seed: int = 0) -> dict[str, torch.Tensor]:
    """Offline fit on calibration text: keys [Hkv, N, D] per layer -> {"layer{l}": basis [Hkv, bits, D]}."""
    out = {}
    for layer, keys in keys_per_layer.items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + layer)
        out[f"layer{layer}"] = fit_basis(keys, bits, iters, gen).cpu().contiguous()
    return out


def load_basis(path: str, bits: int | None = None) -> dict[str, torch.Tensor]:
    """A calibrated basis file -> {"layer{l}": basis [Hkv, b, D]}; one of another width than `bits` is refused."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        basis = load_file(path)
    except (SafetensorError, OSError) as e:
        raise SparseSpecError(f"cannot read basis file {path}: {' '.join(str(e).split())}") from None
    widths = sorted({b.shape[1] for b in basis.values() if b.dim() == 3})
    if bits is not None and widths and widths != [bits]:
        held = f"a {widths[0]}-bit basis" if len(widths) == 1 else f"bases of {', '.join(map(str, widths))} bits"
        hint = f": pass bits={widths[0]}" if len(widths) == 1 else ""
        raise SparseSpecError(f"basis file {path} holds {held} and the policy asks for {bits} bits{hint}")
    return basis
