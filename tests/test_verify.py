"""Speculative verification: greedy prefix rule, and speculative sampling is lossless (chi-square on many draws)."""

import pytest
import torch

from sparsespec.sampling import SamplingConfig
from sparsespec.spec.verify import (
    acceptance_probability,
    draft_distribution,
    speculative_step,
    verify_greedy,
    verify_greedy_rows,
    verify_sampling,
    verify_sampling_rows,
)

V = 8
N = 40_000
TARGET_CFGS = {
    "plain": SamplingConfig(temperature=1.0),
    "temp-topk": SamplingConfig(temperature=0.7, top_k=5),
    "topp": SamplingConfig(temperature=1.3, top_p=0.8),
}
DRAFT_CFG = SamplingConfig(temperature=1.0, top_k=6)  # the drafter's own filter: it has zeros where the target has mass

pytestmark = pytest.mark.usefixtures("one_thread")


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson goodness of fit of counts [C] to probs [C]; 0 if a zero-probability cell was hit. Cells expecting
    fewer than 5 draws are pooled into one. p = the chi-square survival function, regularised upper gamma."""
    counts, probs = counts.double(), probs.double() / probs.double().sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[small].sum().view(1)]) if small.any() else counts[big]
    exp = torch.cat([expected[big], expected[small].sum().view(1)]) if small.any() else expected[big]
    if len(obs) < 2:
        return 1.0
    stat = ((obs - exp) ** 2 / exp).sum()
    return torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2).item()


def make_case(seed: int, k: int, with_draft: bool):
    """-> target logits [k+1, V], drafter distributions [k, V] or None, point-mass proposals [k] (argmax drafts)."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, V, generator=g) * 1.5
    draft_logits = target_logits[:k] + torch.randn(k, V, generator=g)  # a drafter correlated with the target
    p_draft = draft_distribution(draft_logits, DRAFT_CFG) if with_draft else None
    return target_logits, p_draft, draft_logits.argmax(-1)


def draw(target_logits, cfg, p_draft, point, seed, accept=acceptance_probability):
    """N independent verifications -> committed tokens [N, k+1] (-1 past the end), accepted counts [N]."""
    g = torch.Generator().manual_seed(seed)
    k = target_logits.shape[0] - 1
    p_target = draft_distribution(target_logits, cfg).expand(N, k + 1, V)
    if p_draft is None:
        proposals, p_draft_b = point.expand(N, k), None
    else:
        proposals = torch.multinomial(p_draft, N, replacement=True, generator=g).T  # [N, k]: d_i ~ p_draft row i
        p_draft_b = p_draft.expand(N, k, V)
    n, last = speculative_step(proposals, p_target, p_draft_b, g, accept=accept)
    committed = torch.where(torch.arange(k) < n[:, None], proposals, -1)
    committed = torch.cat([committed, torch.full((N, 1), -1)], 1).scatter(1, n[:, None], last[:, None])
    return committed, n


def one_hot_draft(p_draft, point, k):
    return p_draft if p_draft is not None else torch.nn.functional.one_hot(point, V).float().view(k, V)


def first_two_law(p_t, p_d):
    """Exact law of (stop after 1 token, c0) [V] ++ (continue, c0, c1) [V*V] for fixed target rows (k >= 1): c0
    continues iff it is the accepted proposal, with mass min(p_d0, p_t0); the next token then follows p_t row 1."""
    acc0 = torch.minimum(p_d[0], p_t[0])  # [V]
    return torch.cat([p_t[0] - acc0, (acc0[:, None] * p_t[1][None]).flatten()])


def length_law(p_t, p_d, k):
    """P(1 + n_accepted = m), m = 1..k+1: proposal i is accepted with probability alpha_i = sum min(p_d, p_t)."""
    alpha = torch.minimum(p_d, p_t[:k]).sum(-1)  # [k]
    reach = torch.cat([torch.ones(1, dtype=p_t.dtype), alpha.cumprod(0)])  # P(n >= i), i = 0..k
    return reach - torch.cat([reach[1:], torch.zeros(1, dtype=p_t.dtype)])


# ---- greedy


def test_greedy_all_accepted_adds_the_bonus():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(-1)
    assert verify_greedy(best[:3], logits) == best.tolist()


@pytest.mark.parametrize("i", [0, 1, 2])
def test_greedy_stops_at_the_first_mismatch(i):
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(-1)
    proposals = best[:3].clone()
    proposals[i:] = (best[i:3] + 1) % 10  # mismatches from i on: only the first one counts
    assert verify_greedy(proposals, logits) == best[:i].tolist() + [best[i].item()]


def test_greedy_without_proposals_takes_the_argmax():
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(2))
    assert verify_greedy(torch.empty(0, dtype=torch.long), logits) == [logits.argmax().item()]


def test_greedy_rows_equal_verify_greedy_row_by_row():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 6, 4, generator=g)  # few tokens: proposals often match
    best = logits.argmax(-1)
    proposals = [best[0, :5].tolist(), best[1, :2].tolist() + [int(best[1, 2]) ^ 1], [], best[3, :3].tolist(),
                 torch.randint(0, 4, (4,), generator=g).tolist()]
    counts = [len(p) for p in proposals]
    # the padding past a row's proposals is ignored: here it is the target's own tokens, which would all match
    proposed = best[:, :5].clone()
    for r, p in enumerate(proposals):
        proposed[r, :len(p)] = torch.tensor(p, dtype=torch.long)
    rows = verify_greedy_rows(proposed, counts, logits)
    assert rows == [verify_greedy(torch.tensor(p, dtype=torch.long), logits[r, :len(p) + 1])
                    for r, p in enumerate(proposals)]
    assert rows[0] == best[0].tolist() and rows[2] == [int(best[2, 0])] and len(rows[1]) == 3
    assert rows[3] == best[3, :4].tolist()  # its padding matches: still only its 3 proposals count
    with pytest.raises(ValueError):
        verify_greedy_rows(proposed, [6, 0, 0, 0, 0], logits)
    with pytest.raises(ValueError):
        verify_greedy_rows(proposed[:, :3], counts, logits)


def test_greedy_config_delegates_to_verify_greedy():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(3))
    proposals = torch.tensor([logits[0].argmax(), 0, 0])
    assert verify_sampling(proposals, None, logits, SamplingConfig(), None) == verify_greedy(proposals, logits)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError):
        verify_greedy(torch.zeros(3, dtype=torch.long), torch.zeros(3, 10))
    with pytest.raises(ValueError):
        verify_sampling(torch.zeros(2, dtype=torch.long), None, torch.zeros(2, 10), TARGET_CFGS["plain"], None)


# ---- speculative sampling: distribution level


def test_acceptance_probability():
    p_t = torch.tensor([0.2, 0.5, 0.3, 0.0, 0.0])
    p_d = torch.tensor([0.4, 0.25, 0.0, 0.0, 0.1])
    assert torch.equal(acceptance_probability(p_t, p_d), torch.tensor([0.5, 1.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("with_draft", [False, True], ids=["point-mass", "draft-probs"])
@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("cfg_name", list(TARGET_CFGS))
def test_speculative_sampling_is_lossless(cfg_name, k, with_draft):
    cfg = TARGET_CFGS[cfg_name]
    seed = 10 * k + 2 * list(TARGET_CFGS).index(cfg_name) + with_draft
    target_logits, p_draft, point = make_case(seed, k, with_draft)
    committed, n = draw(target_logits, cfg, p_draft, point, seed)
    p_t = draft_distribution(target_logits, cfg).double()  # [k+1, V]
    p_d = one_hot_draft(p_draft, point, k).double()  # [k, V]
    pvalues = {}
    for j in range(k + 1):  # lossless: the j-th committed token, whenever there is one, follows target row j
        reached = n >= j
        pvalues[f"token {j}"] = chi2_pvalue(torch.bincount(committed[reached, j], minlength=V), p_t[j])
    if k:
        cells = torch.where(n == 0, committed[:, 0], V + committed[:, 0] * V + committed[:, 1])
        pvalues["first two"] = chi2_pvalue(torch.bincount(cells, minlength=V + V * V), first_two_law(p_t, p_d))
    pvalues["length"] = chi2_pvalue(torch.bincount(n, minlength=k + 1), length_law(p_t, p_d, k))
    assert min(pvalues.values()) > 1e-3, pvalues


@pytest.mark.parametrize("rule", [
    pytest.param(lambda p_t, p_d: torch.ones_like(p_t), id="always-accept"),
    pytest.param(lambda p_t, p_d: (p_d / p_t).clamp(max=1).nan_to_num(1.0), id="inverted-ratio"),
])
@pytest.mark.parametrize("with_draft", [False, True], ids=["point-mass", "draft-probs"])
def test_a_wrong_acceptance_rule_fails_the_test(rule, with_draft):
    target_logits, p_draft, point = make_case(5, 2, with_draft)
    cfg = TARGET_CFGS["plain"]
    committed, _ = draw(target_logits, cfg, p_draft, point, 5, accept=rule)
    p_t0 = draft_distribution(target_logits[0], cfg)
    assert chi2_pvalue(torch.bincount(committed[:, 0], minlength=V), p_t0) < 1e-9
    committed, _ = draw(target_logits, cfg, p_draft, point, 5)  # the same draws with the right rule pass
    assert chi2_pvalue(torch.bincount(committed[:, 0], minlength=V), p_t0) > 1e-3


def test_empty_residual_falls_back_to_the_target():
    target_logits, _, _ = make_case(6, 1, False)
    p_t = draft_distribution(target_logits, TARGET_CFGS["temp-topk"])
    # draft == target, and a rule that always rejects: max(0, p_t - p_d) has no mass left
    committed, n = draw(target_logits, TARGET_CFGS["temp-topk"], p_t[:1], None, 6,
                        accept=lambda p_t, p_d: torch.zeros_like(p_t))
    assert (n == 0).all()
    assert chi2_pvalue(torch.bincount(committed[:, 0], minlength=V), p_t[0]) > 1e-3


# ---- verify_sampling: the single-sequence entry point


def test_verify_sampling_first_token_follows_the_filtered_target():
    cfg = TARGET_CFGS["topp"]
    target_logits, p_draft, _ = make_case(7, 2, True)
    g = torch.Generator().manual_seed(7)
    firsts = []
    for _ in range(3000):
        proposals = torch.multinomial(p_draft, 1, generator=g).squeeze(-1)
        out = verify_sampling(proposals, p_draft, target_logits, cfg, g)
        assert 1 <= len(out) <= 3 and out[:-1] == proposals[:len(out) - 1].tolist()
        firsts.append(out[0])
    p_t0 = draft_distribution(target_logits[0], cfg)
    assert chi2_pvalue(torch.bincount(torch.tensor(firsts), minlength=V), p_t0) > 1e-3


@pytest.mark.parametrize("with_draft", [False, True], ids=["point-mass", "draft-probs"])
def test_tokens_outside_top_k_are_never_emitted(with_draft):
    cfg = SamplingConfig(temperature=1.0, top_k=2)
    target_logits = torch.randn(4, V, generator=torch.Generator().manual_seed(8))
    allowed = target_logits.topk(2, -1).indices  # [4, 2]
    outside = target_logits.argmin(-1)[:3]  # proposals the filtered target gives probability 0
    p_draft = torch.nn.functional.one_hot(outside, V).float() * 0.9 + 0.1 / V if with_draft else None
    g = torch.Generator().manual_seed(8)
    for _ in range(200):
        out = verify_sampling(outside, p_draft, target_logits, cfg, g)
        assert len(out) == 1 and out[0] in allowed[0].tolist()
    for _ in range(200):  # proposals inside the top-k: every committed token is in its row's top-k
        proposals = allowed[:3, 0]
        out = verify_sampling(proposals, None, target_logits, cfg, g)
        assert all(t in allowed[i].tolist() for i, t in enumerate(out))


def test_verify_sampling_without_proposals_samples_row_zero():
    target_logits = torch.randn(1, V, generator=torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(9)
    outs = [verify_sampling(torch.empty(0, dtype=torch.long), None, target_logits, TARGET_CFGS["plain"], g)
            for _ in range(50)]
    assert all(len(o) == 1 for o in outs) and len({o[0] for o in outs}) > 1


def test_seeded_calls_are_reproducible():
    target_logits, p_draft, _ = make_case(11, 3, True)
    cfg = TARGET_CFGS["temp-topk"]
    proposals = p_draft.argmax(-1)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [verify_sampling(proposals, p_draft, target_logits, cfg, g) for _ in range(40)]

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_sampling_rows_draws_what_each_row_draws_alone(seed):
    """The batched verify of point-mass proposals (one read-back) commits, row by row, exactly what
    `verify_sampling` commits for that row alone from a generator in the same state: rows of odd widths, no
    proposal, every config (greedy too), a row that is not live; proposals partly the target's likely tokens so
    that accepts, rejects and bonus tokens all occur."""
    g = torch.Generator().manual_seed(seed)
    B, w, vocab = 7, 6, 11
    logits = torch.randn(B, w, vocab, generator=g) * 3
    proposed = torch.randint(0, vocab, (B, w - 1), generator=g)
    likely = logits[:, :w - 1].argmax(-1)
    proposed = torch.where(torch.rand(B, w - 1, generator=g) < 0.6, likely, proposed)
    counts = [5, 0, 3, 1, 5, 2, 4]
    cfgs = [TARGET_CFGS["plain"], TARGET_CFGS["topp"], SamplingConfig(), TARGET_CFGS["temp-topk"],
            TARGET_CFGS["plain"], TARGET_CFGS["topp"], SamplingConfig(temperature=0.5)]
    live = [True, True, True, True, False, True, True]
    for trial in range(20):
        gens = [None if c.greedy else torch.Generator().manual_seed(100 * trial + r) for r, c in enumerate(cfgs)]
        alone = [None if c.greedy else torch.Generator().manual_seed(100 * trial + r) for r, c in enumerate(cfgs)]
        got = verify_sampling_rows(proposed, counts, logits, cfgs, gens, live)
        want = [verify_sampling(proposed[r, :counts[r]], None, logits[r, :counts[r] + 1], cfgs[r], alone[r])
                if live[r] else None for r in range(B)]
        assert got == want
        for a, b in zip(gens, alone):  # the generators were advanced alike: later draws agree too
            assert a is None or torch.equal(a.get_state(), b.get_state())
    with pytest.raises(ValueError):
        verify_sampling_rows(proposed, [6] * B, logits, cfgs, [None] * B)

