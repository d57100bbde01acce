"""Tree verification of a DFlash block: the tree's choice and acceptance against brute force, and the loop's output
against plain greedy decoding (every node's path, K/V and drafter context as a line verify would leave them)."""

import random

import pytest
import torch

from sparsespec.errors import SparseSpecError
from sparsespec.generate import GenerationConfig
from sparsespec.sampling import SamplingConfig, sample
from sparsespec.spec.bench import make_drafter
from sparsespec.spec.decode import speculative_generate, tree_verify
from sparsespec.spec.dflash import DFlashDrafter
from sparsespec.spec.drafters import Drafter, LookupFirst
from sparsespec.spec.tree import Pool, TreeVerify, accept, choose, path, pool_paths

from .conftest import CUDA
from .test_spec import tiny_dflash, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7] * 30, list(range(1, 50))]


def node_paths(tree, ids, b: int) -> list[tuple[int, ...]]:
    """Row b's usable nodes as paths of ranks (read back through their ancestor bits and tokens)."""
    out = []
    for j in range(1, tree.tokens.shape[1] + 1):
        if not tree.usable[b, j]:
            continue
        nodes = path(int(tree.ancestors[b, j]))[1:]
        assert nodes[-1] == j and int(tree.depth[b, j]) == len(nodes)
        assert int(tree.parent[b, j]) == (nodes[-2] if len(nodes) > 1 else 0)
        out.append(tuple(int((ids[b, int(tree.depth[b, k]) - 1] == tree.tokens[b, k - 1]).nonzero()[0])
                         for k in nodes))
    return out


@pytest.mark.parametrize("width,n", [(1, 1), (4, 3), (7, 12), (15, 15), (15, 31)])
def test_the_tree_is_the_top_paths_of_the_pool_and_accepts_the_deepest_agreeing_node(width, n):
    """`choose` against a sort of every pool path by its total log-probability; `accept` against a walk of every
    node's path, with targets that follow a random choice at each depth."""
    gen = torch.Generator().manual_seed(width * 100 + n)
    pool = Pool.of(width)
    assert pool_paths(1) == [(0,), (1,), (2,)] and len(pool_paths(15)) == 815
    logp, ids = torch.randn(3, width, 40, generator=gen).log_softmax(-1).topk(3, -1)
    tree = choose(pool, ids, logp, n)
    for b in range(3):
        score = {p: sum(float(logp[b, d, r]) for d, r in enumerate(p)) - 1e-4 * len(p) for p in pool_paths(width)}
        assert set(node_paths(tree, ids, b)) == set(sorted(score, key=lambda p: -score[p])[:n])
    truth = torch.stack([ids[b, torch.arange(width), torch.randint(0, 3, (width,), generator=gen)] for b in range(3)])
    truth[0] = ids[0, :, 0]  # a row whose target follows the argmax line
    best = truth.gather(1, tree.depth.clamp(max=width - 1))  # the target's token after each node, if on its path
    got = accept(tree, best)
    for b in range(3):
        deepest, depth = 0, 0
        for j in range(1, n + 1):
            tokens = [int(tree.tokens[b, k - 1]) for k in path(int(tree.ancestors[b, j]))[1:]]
            if tokens == truth[b, :len(tokens)].tolist() and len(tokens) > depth:
                deepest, depth = j, len(tokens)
        assert int(got[b]) == deepest


def test_a_depth_limit_keeps_the_best_shallow_paths_and_never_accepts_a_deeper_node():
    """With a row's limit d, its usable nodes are the top paths of depth <= d (as `choose` of the pool cut at d);
    nodes past it fill the tree but are never accepted, even where the target follows them; d = 0 accepts the
    root alone."""
    gen = torch.Generator().manual_seed(9)
    width, n = 6, 10
    logp, ids = torch.randn(3, width, 30, generator=gen).log_softmax(-1).topk(3, -1)
    limit = torch.tensor([0, 2, width])
    tree = choose(Pool.of(width), ids, logp, n, limit)
    assert not tree.usable[0, 1:].any() and tree.usable[2].all()
    score = {p: sum(float(logp[1, d, r]) for d, r in enumerate(p)) - 1e-4 * len(p) for p in pool_paths(width)}
    shallow = sorted((p for p in score if len(p) <= 2), key=lambda p: -score[p])
    assert set(node_paths(tree, ids, 1)) == set(shallow[:n]) and int(tree.usable[1].sum()) == 1 + min(n, len(shallow))
    best = ids[:, :, 0].gather(1, tree.depth.clamp(max=width - 1))  # targets that follow the argmax line
    got = accept(tree, best)
    free = choose(Pool.of(width), ids, logp, n)  # no limit: row 2's tree and its acceptance alike
    assert torch.equal(free.tokens[2], tree.tokens[2]) and torch.equal(free.ancestors[2], tree.ancestors[2])
    assert int(got[0]) == 0 and int(tree.depth[1, got[1]]) == 2 and int(got[2]) == int(accept(free, best)[2])


def test_a_pool_path_never_outscores_its_prefix_even_with_positive_scores():
    """Scores above 0 (not log-probabilities) are clipped: the chosen nodes still form a tree."""
    ids = torch.arange(12).view(1, 4, 3)
    logp = torch.tensor([[[-5.0, -6, -7], [3, 2, 1], [3, 2, 1], [3, 2, 1]]])
    tree = choose(Pool.of(4), ids, logp, 6)
    assert all(len(p) == 1 or p[:-1] in node_paths(tree, ids, 0) for p in node_paths(tree, ids, 0))


class Oracle(Drafter):
    """Knows each prompt's greedy answer: at every block position that answer's token at a random rank (0 most
    often), other tokens at the other ranks: its trees accept deep paths that are not the argmax line."""
    name = "oracle"
    point_mass = marginals = True

    def __init__(self, answers: list[list[int]], seed: int = 0):
        self.answers, self.rng, self.ranks, self.width = answers, random.Random(seed), 0, 7

    def start(self, prompts, features, capacity):
        pass

    def choices(self, ranks):
        self.ranks = ranks

    def propose(self, histories, ks, cfgs, rngs):
        raise AssertionError("greedy rows only")

    def propose_choices(self, histories, ks, device):
        B, K, R = len(histories), self.width, self.ranks
        logp = torch.sort(torch.rand(B, K, R), -1, descending=True).values.log()
        ids = torch.zeros(B, K, R, dtype=torch.long)
        for b, h in enumerate(histories):
            full = next((a for a in self.answers if h is not None and a[:len(h)] == h), None)
            for j in range(K):
                token = full[len(h) + j] if full is not None and len(h) + j < len(full) else 0
                r = self.rng.choice([0, 0, 0, 1, 2])
                ids[b, j] = torch.tensor([(token + 1 + x) % 64 for x in range(R)])
                ids[b, j, r] = token
        return ids, logp, [0 if h is None else min(k, K) for h, k in zip(histories, ks)]

    def propose_greedy(self, histories, ks, device):
        ids, _, counts = self.propose_choices(histories, ks, device)
        return ids[..., 0], counts


@pytest.mark.parametrize("nodes", [1, 6, 20])
def test_a_tree_verify_of_deep_side_paths_is_token_identical_to_plain_greedy(nodes):
    """An oracle drafter whose answer tokens often sit at ranks 1-2: the accepted paths leave the argmax line, so
    their K/V are moved after the pending token; a batch of rows of different lengths, each row as plain greedy."""
    target = tiny_engine(0)
    gen = GenerationConfig(max_new_tokens=40)
    plain = target.generate(PROMPTS, gen).token_ids
    drafter = Oracle([p + a for p, a in zip(PROMPTS, plain)])
    drafter.tree_nodes = nodes
    out = speculative_generate(target, PROMPTS, drafter, gen, 8)
    assert [o.token_ids for o in out] == plain
    if nodes > 1:
        assert all(o.tau > 2 for o in out)  # deep paths were accepted


@pytest.mark.parametrize("block,nodes", [(5, 1), (5, 4), (8, 9), (8, 31)])
def test_dflash_verified_as_a_tree_is_token_identical_and_keeps_its_context(block, nodes):
    """The DFlash drafter as a tree (its choices through `draft_choices`): greedy output equals plain greedy for a
    batch; after every step its context cache holds what ingesting the target's features over each row's committed
    tokens gives (the accepted path's features, reordered into a line)."""
    target = tiny_engine(0)
    gen = GenerationConfig(max_new_tokens=30)
    plain = target.generate(PROMPTS, gen).token_ids
    seqs = [p + a for p, a in zip(PROMPTS, plain)]
    features = [target.model.forward_tapped(torch.tensor([s]), torch.arange(len(s))[None], _fresh_cache(target),
                                            len(s), tiny_dflash(target, block=block).cfg.taps)[1][0] for s in seqs]
    checked = []

    class Checked(DFlashDrafter):
        def commit(self, lengths, accepted, feats):
            super().commit(lengths, accepted, feats)
            fresh = DFlashDrafter(self.model, target.model)
            for r, a in enumerate(accepted):
                if a is None:
                    continue
                n = self.cache.lengths[r]
                fresh.start([seqs[r][:n]], [features[r][:n]], len(seqs[r]) + block)
                for k_loop, k_fresh in zip(self.cache.k, fresh.cache.k):
                    assert torch.allclose(k_loop[r, :, :n], k_fresh[0, :, :n], atol=1e-5), (r, n)
                checked.append(a)

    drafter = Checked(tiny_dflash(target, block=block), target.model)
    drafter.tree_nodes = nodes
    out = speculative_generate(target, PROMPTS, drafter, gen, block)
    assert [o.token_ids for o in out] == plain and checked


def test_prompt_lookup_in_front_of_a_tree_copies_and_stays_token_identical():
    """`ngram+treeN:dflash`: rows whose history recurs put the lookup's copy in their trees (its line first), the
    others the drafter's choices, and a step where every row copies skips the drafter; greedy output equals plain
    greedy for a batch of both kinds of rows and for one of copying rows (some of its steps copy in every row)."""
    target = tiny_engine(0)
    gen = GenerationConfig(max_new_tokens=30)
    drafter = DFlashDrafter(tiny_dflash(target, block=5), target.model)
    drafter.tree_nodes = 6
    for prompts in ([[5, 6, 7, 8] * 6, [3, 1, 4, 1, 5, 9, 2, 6], [9, 8] * 10], [[5, 6, 7, 8] * 6, [9, 8] * 10]):
        out = speculative_generate(target, prompts, LookupFirst(drafter, min_n=2, min_tokens=1), gen, 5)
        assert [o.token_ids for o in out] == target.generate(prompts, gen).token_ids
        steps = list(zip(*(o.copied for o in out)))  # per step (while every row ran): which rows copied
        assert any(any(s) for s in steps) and not all(all(s) for s in steps)
    assert any(all(s) for s in steps)  # (the second batch) steps where every row copied: no drafter ran


def test_a_copy_fills_its_tree_before_a_confident_drafter_s_alternatives():
    """A copying row's tree holds the copy's whole line even where the drafter is sure of another token at every
    position; its leftover nodes extend the copy with the drafter's choices past it."""
    class Sure(Drafter):  # per position: token 40 + j certain (log-probability ~0), then 50 + j, 60 + j
        name, point_mass, marginals = "sure", True, True
        max_proposals = 6

        def start(self, prompts, features, capacity):
            pass

        def propose(self, histories, ks, cfgs, rngs):
            raise AssertionError

        def choices(self, ranks):
            pass

        def propose_choices(self, histories, ks, device):
            j = torch.arange(6)
            ids = torch.stack([40 + j, 50 + j, 60 + j], -1).expand(len(histories), -1, -1)
            logp = torch.tensor([-1e-7, -18.0, -19.0]).expand(len(histories), 6, -1)
            return ids, logp, [6] * len(histories)

    lookup = LookupFirst(Sure(), min_n=2, min_tokens=1)
    lookup.start([[1, 2, 3, 7, 8, 1, 2], [9, 9, 5]], None, 64)
    lookup.choices(3)
    ids, logp, _ = lookup.propose_choices([[1, 2, 3, 7, 8, 1, 2], [9, 9, 5]], [6, 6], torch.device("cpu"))
    tree = choose(Pool.of(6), ids, logp, 5)
    copy = [3, 7, 8, 1, 2]  # what follows the last earlier "1 2"
    lines = [[int(tree.tokens[0, k - 1]) for k in path(int(tree.ancestors[0, j]))[1:]] for j in range(1, 6)]
    assert sorted(lines, key=len) == [copy[:d] for d in range(1, 6)]
    assert [int(t) for t in tree.tokens[1]] != copy and set(int(t) for t in tree.tokens[1]) <= {40, 41, 42, 43, 44,
                                                                                               45, 50, 51}
    more = choose(Pool.of(6), ids, logp, 7)  # two nodes over the copy's five: its line extended by the drafter
    lines = [[int(more.tokens[0, k - 1]) for k in path(int(a))[1:]] for a in more.ancestors[0, 1:]]
    assert sorted(line for line in lines if len(line) == 6) == [copy + [45], copy + [55]]


def _fresh_cache(engine):
    from sparsespec.cache import KVCache

    return KVCache(engine.config, 1, 256, torch.float32, "cpu")


@pytest.mark.parametrize("lookup", [False, True])
def test_sampled_tree_speculation_is_distributed_as_plain_sampling(monkeypatch, lookup):
    """At T = 1 a tree verify draws the target's token after every node and walks the nodes it matches: its
    sequences are distributed as plain sampling's (chi-square homogeneity over the 64 three-token sequences of a
    4-token vocabulary, the reference shared with the line's test), and a wrong rule (the target's argmax at the
    nodes, a draw only at the root) fails the same test."""
    from sparsespec.spec import decode

    from .test_spec import SAMPLES, SAMPLING_PROMPT, _chi2_pvalue, _plain_sampling_counts, _sequence_counts

    target = tiny_engine(3, vocab=4, scale=4.0)
    dflash = tiny_dflash(target, block=3)
    steps = []

    def spec(i):
        drafter = DFlashDrafter(dflash, target.model)
        drafter.tree_nodes = 3  # of the 3 x 2 pool paths: a branching tree
        if lookup:  # 2-grams over 4 tokens recur: most steps copy into the tree
            drafter = LookupFirst(drafter, min_n=2, min_tokens=1)
        g = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=1.0, seed=20_000 + i),
                             stop_on_eos=False)
        out = speculative_generate(target, [SAMPLING_PROMPT], drafter, g, 3)[0]
        steps.append(len(out.committed))
        return out.token_ids

    ref = _plain_sampling_counts()
    calls, step = [], decode.tree_step
    monkeypatch.setattr(decode, "tree_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    assert _chi2_pvalue(_sequence_counts(spec, SAMPLES), ref) > 1e-3
    assert calls and sum(steps) < 2 * SAMPLES  # the tree verified, and accepted drafts

    def root_only(logits, cfg, generator):  # a wrong rule: the argmax after every node but the root
        drawn = logits.argmax(-1)
        drawn[0] = sample(logits[:1], cfg, generator)[0]
        return drawn

    monkeypatch.setattr(decode, "sample", root_only)
    assert _chi2_pvalue(_sequence_counts(spec, 300), ref) < 1e-6


def test_a_block_wider_than_the_drafter_s_keeps_the_tree_within_the_drafter_s_block():
    """--block-size above the DFlash drafter's own block: the tree's paths stop at the drafter's block (as its line
    does), greedy output stays plain greedy's."""
    target = tiny_engine(0)
    drafter = DFlashDrafter(tiny_dflash(target, block=5), target.model)
    drafter.tree_nodes = 9
    gen = GenerationConfig(max_new_tokens=20)
    out = speculative_generate(target, PROMPTS, drafter, gen, 12)
    assert [o.token_ids for o in out] == target.generate(PROMPTS, gen).token_ids
    assert max(max(o.committed) for o in out) <= 5


def test_bench_refuses_a_tree_too_big_for_its_block_before_measuring_anything(tmp_path):
    """`bench spec` with a tree of more nodes than the block's pool holds: one clear error, and no row written (it
    used to come after the first prompt's plain and other drafters' rows)."""
    from sparsespec.spec.bench import BenchConfig, run_bench

    target = tiny_engine(0)
    tree = DFlashDrafter(tiny_dflash(target, block=5), target.model)
    tree.tree_nodes = 30  # a block of 3: paths 2 deep, 9 of them
    cfg = BenchConfig(drafters=("line", "tree"), prompts=1, kinds=("code",), temperatures=(0.0,), max_new_tokens=4,
                      block_size=3)
    with pytest.raises(SparseSpecError, match="takes 1 to 9 nodes, got 30"):
        run_bench(target, {"line": DFlashDrafter(tiny_dflash(target, block=5), target.model), "tree": tree}, cfg,
                  tmp_path)
    assert not (tmp_path / "spec.jsonl").exists() or not (tmp_path / "spec.jsonl").read_text()


def test_sampled_tree_rows_in_a_batch_get_what_they_get_alone():
    """At T = 1 each row of a batch draws with its own generator and limits its tree by its own proposal budget:
    batched output equals each prompt run alone (rows of different lengths reach their ends at different steps)."""
    target = tiny_engine(0)
    dflash = tiny_dflash(target, block=5)

    def run(prompts):
        drafter = DFlashDrafter(dflash, target.model)
        drafter.tree_nodes = 6
        gen = GenerationConfig(max_new_tokens=21, sampling=SamplingConfig(temperature=1.0, seed=7))
        return [o.token_ids for o in speculative_generate(target, prompts, drafter, gen, 5)]

    assert run(PROMPTS) == [run([p])[0] for p in PROMPTS]


def test_tree_drafter_specs(tmp_path):
    target = tiny_engine(0)
    tiny_dflash(target).save(tmp_path / "d")
    drafter = make_drafter(f"tree9:dflash:{tmp_path / 'd'}", target, "tiny")
    assert drafter.tree_nodes == 9 and drafter.name == f"tree9:dflash:{tmp_path / 'd'}"
    both = make_drafter(f"ngram+tree9:dflash:{tmp_path / 'd'}", target, "tiny")
    assert isinstance(both, LookupFirst) and both.tree_nodes == 9 and both.marginals
    for spec, match in (("tree9:ngram", "per-position choices"), ("treex:dflash", "number of tree nodes"),
                        ("tree0:dflash", "number of tree nodes"), ("tree\u00b2:dflash", "number of tree nodes"),
                        (f"tree15:tree3:dflash:{tmp_path / 'd'}", "one tree a drafter"),
                        ("tree9:model:no-such-model", "per-position choices"), ("tree9:none", "per-position choices")):
        with pytest.raises(SparseSpecError, match=match):
            make_drafter(spec, target, "tiny")
    drafter.tree_nodes = 900
    with pytest.raises(SparseSpecError, match="takes 1 to"):
        speculative_generate(target, PROMPTS[:1], drafter, GenerationConfig(max_new_tokens=4), 5)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_a_captured_tree_verify_equals_the_eager_one_over_several_replays():
    """`TreeVerify` captured as two CUDA graphs gives, replay after replay with new inputs, the eager one's block,
    tree, read-back table, path-ordered features and cache (the accepted paths' K/V moved; rows not live untouched)."""
    from sparsespec.cache import KVCache
    from sparsespec.config import ModelConfig

    B, n, F, dev = 3, 9, 24, torch.device("cuda")
    cfg = ModelConfig(arch="llama", vocab_size=10, hidden_size=32, intermediate_size=8, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position=64)
    caches = [KVCache(cfg, B, 48, torch.bfloat16, dev) for _ in range(2)]
    gen = torch.Generator().manual_seed(3)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        a.copy_(torch.randn(a.shape, generator=gen))
        b.copy_(a)
    pool = Pool.of(7, device=dev)
    graphed, eager = TreeVerify(pool, n), TreeVerify(pool, n)
    graphed.capture(caches[0], (F, torch.bfloat16))
    for step in range(4):
        logp, ids = torch.randn(B, 7, 5, generator=gen).log_softmax(-1).topk(pool.ranks_needed, -1)
        ids, logp = (ids % 3).to(dev), logp.to(dev)  # few distinct tokens: paths get accepted
        pending = torch.randint(0, 3, (B,), generator=gen).to(dev)
        best = torch.randint(0, 3, (B, n + 1), generator=gen).to(dev)
        features = torch.randn(B, n + 1, F, generator=gen).to(dev, torch.bfloat16)
        live = torch.tensor([True, step % 2 == 0, True], device=dev)
        starts = torch.randint(0, 48 - n - 1, (B,), generator=gen).to(dev)
        limit = torch.randint(0, 8, (B,), generator=gen).to(dev)
        drafted = [t.draft(ids, logp, pending, limit) for t in (graphed, eager)]
        assert torch.equal(drafted[0][0], drafted[1][0])
        assert all(torch.equal(a, b) for a, b in zip(drafted[0][1], drafted[1][1]))
        settled = [t.settle(best, features, live, starts, c) for t, c in zip((graphed, eager), caches)]
        assert torch.equal(settled[0][0], settled[1][0]) and torch.equal(settled[0][1], settled[1][1])
        assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))


def test_a_drafters_tree_verify_is_kept_for_later_calls_of_the_same_shape():
    """A loop's calls share one `TreeVerify` (with the graphs it captured); another block depth or node count builds
    a new one, and a line drafter gets none."""

    target = tiny_engine(0)
    d = DFlashDrafter(tiny_dflash(target, block=8), target.model)
    assert tree_verify(d, 8, torch.device("cpu")) is None and d.ranks == 0
    d.tree_nodes = 9
    first = tree_verify(d, 8, torch.device("cpu"))
    assert tree_verify(d, 8, "cpu") is first and d.ranks == first.pool.ranks_needed
    assert tree_verify(d, 6, "cpu") is not first  # paths 5 deep, not 7
    d.tree_nodes = 4
    assert tree_verify(d, 6, "cpu").n == 4


def test_a_kept_tree_verify_drops_its_graphs_for_an_eager_runner():
    """A drafter's tree verify kept from a graphed loop, then used with a runner that runs eagerly (a CPU runner
    here), runs eagerly: no graphs of another cache are replayed."""
    from sparsespec.runner import Runner

    target = tiny_engine(0)
    d = DFlashDrafter(tiny_dflash(target, block=8), target.model)
    d.tree_nodes = 9
    tree = tree_verify(d, 8, "cpu")
    tree.graphs, tree.bound = ("stale", "graphs"), (lambda: object())  # as a graphed loop would leave them
    tree.bind(Runner(target.model, 1, 64, taps=d.taps))
    assert tree.graphs is None and tree.bound() is None
