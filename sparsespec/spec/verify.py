"""Lossless verification of speculative proposals: greedy prefix match and Leviathan et al. speculative sampling."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..attention.policy import device_ints
from ..sampling import SamplingConfig, filter_logits

AcceptRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_shapes(proposals: torch.Tensor, target_logits: torch.Tensor) -> None:
    if proposals.dim() != 1 or target_logits.dim() != 2 or target_logits.shape[0] != proposals.shape[0] + 1:
        raise ValueError(f"need proposals [k] and target logits [k+1, V], got {tuple(proposals.shape)} and "
                         f"{tuple(target_logits.shape)}")


def _greedy_prefix(proposals: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """proposals [k], target_logits [k+1, V] -> (accepted proposals n [1], the target's argmax [k+1]), on the device:
    the committed tokens are argmax[:n + 1] (accepted proposals equal the argmax)."""
    best = target_logits.argmax(-1)  # [k+1]
    return (best[:-1] == proposals).long().cumprod(0).sum().view(1), best


def verify_greedy(proposals: torch.Tensor, target_logits: torch.Tensor) -> list[int]:
    """proposals [k] int64, target_logits [k+1, V] -> the longest prefix of proposals matching the target's argmax,
    then the target's argmax at the first mismatch (or the bonus after all k): 1..k+1 tokens."""
    _check_shapes(proposals, target_logits)
    n, best = _greedy_prefix(proposals, target_logits)
    out = torch.cat([n, best]).tolist()  # one host sync
    return out[1:out[0] + 2]  # accepted proposals equal the argmax, so the committed tokens are best[:n+1]


def verify_greedy_rows(proposed: torch.Tensor, counts: list[int], target_logits: torch.Tensor) -> list[list[int]]:
    """`verify_greedy` for a batch in one host read-back: proposed [B, w − 1] token ids on the logits' device (row
    r's first counts[r] proposed, the rest padding of any value), target_logits [B, w, V] (row r's first
    counts[r] + 1 positions used) -> per row its 1..counts[r] + 1 committed tokens."""
    B, w, _ = target_logits.shape
    if proposed.shape != (B, w - 1) or len(counts) != B or any(not 0 <= c <= w - 1 for c in counts):
        raise ValueError(f"need at most {w - 1} proposals for each of {B} rows, got {list(proposed.shape)} "
                         f"proposed, counts {counts}")
    best = target_logits.argmax(-1)  # [B, w]
    proposing = torch.arange(w - 1, device=best.device) < device_ints(counts, best.device)[:, None]  # [B, w - 1]
    n = ((best[:, :w - 1] == proposed) & proposing).long().cumprod(1).sum(1)  # [B] accepted proposals
    out = torch.cat([n[:, None], best], 1).tolist()  # one sync
    return [row[1:row[0] + 2] for row in out]


def draft_distribution(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> the filtered sampling distribution [..., V] (one-hot argmax when cfg is greedy).

    Verification uses it for the target rows; a sampling drafter must draw from (and report) the same thing."""
    if cfg.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return filter_logits(logits, cfg).softmax(-1)


def acceptance_probability(p_target_d: torch.Tensor, p_draft_d: torch.Tensor) -> torch.Tensor:
    """min(1, p_t(d) / p_d(d)) elementwise; 0 where p_d(d) == 0 (a proposal its drafter could not have drawn)."""
    ratio = p_target_d / p_draft_d.clamp(min=torch.finfo(p_draft_d.dtype).tiny)
    return torch.where(p_draft_d > 0, ratio.clamp(max=1.0), 0.0)


def speculative_step(proposals: torch.Tensor, p_target: torch.Tensor, p_draft: torch.Tensor | None,
                     generator: torch.Generator | None, *,
                     accept: AcceptRule = acceptance_probability) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched speculative sampling on probabilities, no host sync.

    proposals [B, k] int64; p_target [B, k+1, V] (row i: after proposals[:i]); p_draft [B, k, V] or None for
    point-mass proposals -> (n_accepted [B] in 0..k, next_token [B]: drawn from norm(max(0, p_t - p_d)) at the
    first rejection, from p_t row k when all k are accepted)."""
    B, k = proposals.shape
    V = p_target.shape[-1]
    pt_d = p_target[:, :k].gather(-1, proposals[..., None]).squeeze(-1)  # [B, k]
    pd_d = torch.ones_like(pt_d) if p_draft is None else p_draft.gather(-1, proposals[..., None]).squeeze(-1)
    u = torch.rand(B, k, generator=generator, device=p_target.device)  # [B, k]
    n = (u < accept(pt_d, pd_d)).long().cumprod(-1).sum(-1)  # [B]: leading accepted proposals
    p_next = p_target.gather(1, n.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # [B, V]: p_t row n
    residual = p_next
    if k:
        i = n.clamp(max=k - 1).view(B, 1)  # [B, 1]: the rejected row (ignored when n == k)
        if p_draft is None:
            pd_next = torch.zeros_like(p_next).scatter_(1, proposals.gather(1, i), 1.0)  # [B, V] one-hot
        else:
            pd_next = p_draft.gather(1, i.view(B, 1, 1).expand(B, 1, V)).squeeze(1)  # [B, V]
        residual = (p_next - pd_next * (n < k).view(B, 1)).clamp(min=0)
    # all-zero residual (p_t == p_d up to rounding): fall back to p_t
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    return n, torch.multinomial(residual, 1, generator=generator).squeeze(-1)


def verify_sampling(proposals: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                    cfg: SamplingConfig, generator: torch.Generator | None, *,
                    accept: AcceptRule = acceptance_probability) -> list[int]:
    """proposals [k] int64, draft_probs [k, V] (the filtered distributions the proposals were drawn from) or None
    (point masses), target_logits [k+1, V] fp32 -> 1..k+1 committed tokens, distributed exactly as sampling from
    softmax(filter_logits(target_logits, cfg)) token by token. cfg.greedy delegates to verify_greedy."""
    if cfg.greedy:
        return verify_greedy(proposals, target_logits)
    _check_shapes(proposals, target_logits)
    p_target = draft_distribution(target_logits, cfg)[None]  # [1, k+1, V]
    p_draft = None if draft_probs is None else draft_probs[None].float()  # [1, k, V]
    n, last = speculative_step(proposals[None], p_target, p_draft, generator, accept=accept)
    out = torch.cat([n, proposals, last]).tolist()  # one host sync
    return out[1:out[0] + 1] + out[-1:]


def verify_sampling_rows(proposed: torch.Tensor, counts: list[int], target_logits: torch.Tensor,
                         cfgs: list[SamplingConfig], generators: list[torch.Generator | None],
                         live: list[bool] | None = None, *,
                         accept: AcceptRule = acceptance_probability) -> list[list[int] | None]:
    """`verify_sampling` of point-mass proposals for a batch, in one host read-back: proposed [B, w − 1] token ids
    on the logits' device (row r's first counts[r] proposed, the rest padding), target_logits [B, w, V] fp32 ->
    per row its 1..counts[r] + 1 committed tokens (None for a row that is not `live`). Row r is verified under
    cfgs[r] with generators[r], drawing exactly what `verify_sampling` draws for that row alone (greedy rows as
    `verify_greedy`); nothing is read back before every row is done."""
    B, w, _ = target_logits.shape
    live = [True] * B if live is None else live
    if proposed.shape != (B, w - 1) or not len(counts) == len(cfgs) == len(generators) == len(live) == B \
            or any(not 0 <= c <= w - 1 for c in counts):
        raise ValueError(f"need at most {w - 1} proposals, a config and a generator for each of {B} rows, got "
                         f"{list(proposed.shape)} proposed, counts {counts}")
    rows = []
    for r, (k, cfg, on) in enumerate(zip(counts, cfgs, live)):
        mine = proposed[r, :k]  # [k]
        if not on:
            n, tokens = mine.new_zeros(1), mine.new_zeros(k + 1)
        elif cfg.greedy:
            n, tokens = _greedy_prefix(mine, target_logits[r, :k + 1])  # committed: tokens[:n + 1]
        else:
            p_target = draft_distribution(target_logits[r, :k + 1], cfg)[None]  # [1, k + 1, V]
            n, last = speculative_step(mine[None], p_target, None, generators[r], accept=accept)  # [1], [1]
            tokens = torch.cat([mine, last]).scatter(0, n, last)  # [k + 1]: the accepted, then the drawn token
        rows.append(torch.cat([n, tokens, tokens.new_zeros(w - 1 - k)]))  # [1 + w]
    out = torch.stack(rows).tolist()  # one sync
    return [row[1:row[0] + 2] if on else None for row, on in zip(out, live)]

