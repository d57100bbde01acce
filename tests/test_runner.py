"""The decode runner's fixed-width sparse path (the one CUDA graphs capture) against the eager reference path:
the same selections and outputs on random caches, dense greedy tokens at a full budget on the real model, and the
index following rollbacks."""

import pytest
import torch

from sparsespec.attention import POLICIES, make_policy
from sparsespec.generate import GenerationConfig, sample
from sparsespec.runner import Runner
from sparsespec.sampling import SamplingConfig

from .conftest import CUDA, cache_with_keys
from .test_binarypc import anisotropic_keys

GRAPHABLE = [name for name, cls in POLICIES.items() if cls.graphable]


def test_graphable_policies_are_declared():
    assert {"binarypc", "topk", "streaming", "quest", "doublesparse", "doublep"} <= set(GRAPHABLE)
    assert not POLICIES["magicpig"].graphable
    assert not make_policy("doublep", {"decoded": "recluster"}).graphable  # re-clustering sizes on the host
    assert POLICIES["binarypc"].row_index and not POLICIES["doublep"].row_index  # serve needs build_row


@pytest.mark.parametrize("name,options", [
    ("binarypc", {"budget": 0.05, "sinks": 2, "window": 3}), ("binarypc", {"budget": 7, "safeguard": 0.3}),
    ("binarypc", {"budget": 0.2, "bits": 100, "probe_bits": 4}), ("topk", {"budget": 0.1, "window": 5}),
    ("streaming", {"budget": 0.1}), ("streaming", {"budget": 1.0, "sinks": 0}),
    ("streaming", {"budget": 3, "sinks": 6, "window": 2}), ("streaming", {"budget": 0.3, "sinks": 1, "window": 40}),
    ("topk", {"budget": 1.0}), ("quest", {"budget": 0.1, "page": 7}),
    ("quest", {"budget": 0.3, "page": 16, "sinks": 3}), ("doublesparse", {"budget": 0.1, "channels": 4})])
def test_fixed_width_step_equals_eager_step(name, options, tmp_path):
    B, Hkv, S, D = 2, 2, 150, 16
    keys = anisotropic_keys(B * Hkv, S, D, seed=len(options)).view(B, Hkv, S, D)
    cache = cache_with_keys(keys)
    lengths = [S - 10, 97]
    if name == "doublesparse":
        options = {**options, "labels": label_file(tmp_path, Hkv, D)}
    policy = make_policy(name, {**options, "dense_layers": 0})
    policy.build(0, cache, lengths)
    q = torch.randn(B, 2 * Hkv, 1, D, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor(lengths)
    with policy.stepping(lengths):
        idx, valid = policy.select(0, q, cache, positions)
        eager = policy.decode(0, q, cache, positions)
    policy.plan_fixed(cache, lengths)
    policy.begin_step(positions)
    fixed = policy.decode(0, q, cache, positions)
    plan = policy.fixed
    for r in range(B * Hkv):
        b, h = divmod(r, Hkv)
        assert sorted(idx[b, h][valid[b, h]].tolist()) == plan.idx[r, :plan.count[r]].tolist()
    assert torch.allclose(fixed, eager, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(CUDA, reason="runs the kernels on CPU tensors (Triton's interpreter, set only without CUDA); "
                    "on CUDA the graphed steps' tests (test_cuda.py) run them")
@pytest.mark.parametrize("candidates", [False, True])
def test_binarypc_fixed_step_through_either_scorer_kernel_equals_the_eager_step(monkeypatch, candidates):
    """The fixed-width step through the Triton kernels (interpreted here, as they run on CUDA): the table scorer and
    the dp4a scorer select what the eager step selects — on the select's radix path, and on its candidate path
    (taken here at any size), whose threshold is sampled from the copy of the sampled slots' keys the scorer
    writes."""
    import sparsespec.kernels
    from sparsespec.kernels import select
    from sparsespec.kernels.binarypc import sampled_keys_ref

    monkeypatch.setattr(sparsespec.kernels, "triton_ready", lambda device: True)
    monkeypatch.setattr(select, "takes_candidates", lambda *a, **kw: candidates)
    copies = []
    topk = select.select_topk

    def spy(keys, positions, *a, samples=None, **kw):  # the copy as the scorer wrote it: the sampled slots' keys
        if samples is not None:
            live = select.sampled_slots(keys.shape[1]) <= positions.long().repeat_interleave(Hkv)[:, None]
            assert torch.equal(samples[live], sampled_keys_ref(keys)[live])
        copies.append(samples is not None)
        return topk(keys, positions, *a, samples=samples, **kw)

    monkeypatch.setattr(select, "select_topk", spy)
    B, Hkv, S, D = 2, 2, 150, 16
    cache = cache_with_keys(anisotropic_keys(B * Hkv, S, D, seed=4).view(B, Hkv, S, D))
    lengths = [S - 10, 97]
    q = torch.randn(B, 2 * Hkv, 1, D, generator=torch.Generator().manual_seed(2))
    positions = torch.tensor(lengths)
    for scorer in ("tables", "dp4a"):
        policy = make_policy("binarypc", {"budget": 0.1, "sinks": 2, "window": 3, "dense_layers": 0,
                                          "min_tokens": 0, "scorer": scorer})
        policy.build(0, cache, lengths)
        with policy.stepping(lengths):
            idx, valid = policy.select(0, q, cache, positions)
        policy.plan_fixed(cache, lengths)
        policy.begin_step(positions)
        policy.decode(0, q, cache, positions)
        plan = policy.fixed
        for r in range(B * Hkv):
            b, h = divmod(r, Hkv)
            assert sorted(idx[b, h][valid[b, h]].tolist()) == plan.idx[r, :plan.count[r]].tolist(), scorer
    assert copies == [candidates] * 2  # the copy made whenever the select is to sample


def label_file(folder, num_kv_heads: int, head_dim: int) -> str:
    """Double Sparsity label channels (random, but a valid file) for a one-layer cache."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    labels = torch.stack([torch.randperm(head_dim, generator=g)[:8] for _ in range(num_kv_heads)])
    save_file({"layer0": labels}, str(folder / "labels.safetensors"))
    return str(folder / "labels.safetensors")


def test_quest_index_follows_fixed_width_steps():
    B, Hkv, S, D = 2, 2, 90, 16
    keys = anisotropic_keys(B * Hkv, S, D, seed=9).view(B, Hkv, S, D)
    caches = [cache_with_keys(keys) for _ in range(2)]
    caches[1].v[0].copy_(caches[0].v[0])
    fixed, eager = (make_policy("quest", {"budget": 0.2, "dense_layers": 0, "page": 8}) for _ in range(2))
    for policy, cache in zip((fixed, eager), caches):
        policy.build(0, cache, [40, 61])
    fixed.plan_fixed(caches[0], [40, 61])
    q = torch.randn(B, 2 * Hkv, 1, D)
    for step in range(12):  # fixed-width steps keep the pages current on their own; eager steps through append
        lengths = [40 + step, 61 + step]
        positions = torch.tensor(lengths)
        eager.append(0, caches[1], lengths)
        with eager.stepping(lengths):
            want = eager.decode(0, q, caches[1], positions)
        fixed.begin_step(positions)
        got = fixed.decode(0, q, caches[0], positions)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), step
    fixed_state, eager_state = (c.policy_state[0] for c in caches)
    for row, n in enumerate([40 + 11, 61 + 11]):  # the pages holding committed slots agree
        pages = -(-n // 8)
        assert torch.equal(fixed_state.kmin[row, :, :pages], eager_state.kmin[row, :, :pages])
        assert torch.equal(fixed_state.kmax[row, :, :pages], eager_state.kmax[row, :, :pages])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in GRAPHABLE if n not in ("doublesparse", "doublep")])
def test_full_budget_fixed_width_reproduces_dense_greedy(smollm2_engine, smollm2_wiki_greedy, name):
    eng = smollm2_engine
    prompt, dense = smollm2_wiki_greedy[0], smollm2_wiki_greedy[1][:16]  # (the session's dense generation)
    runner = Runner(eng.model, 1, len(prompt) + 16, make_policy(name, {"budget": "1.0", "dense_layers": "0"}),
                    fixed=True)
    token = sample(eng.model.logits(runner.prefill([prompt])), SamplingConfig(), None)
    out = [int(token)]
    for _ in range(15):
        token = sample(runner.decode(token), SamplingConfig(), None)
        out.append(int(token))
    assert out == dense
    assert runner.policy.mean_attended == pytest.approx(len(prompt) + 8, abs=1)  # every token, every step


@torch.inference_mode()
@pytest.mark.parametrize("decoded", ["assign", "window"])
def test_doublep_in_the_runner_fixed_path_equals_its_eager_path(decoded):
    """Double-P's fixed-width steps (static widths, clustering inside the step) through the runner: the eager
    runner's tokens at its defaults, the dense tokens at p1 = p2 = 1, over a rollback."""
    from .test_spec import tiny_engine

    model = tiny_engine(0, layers=3).model
    prompts = [[(7 * i) % 60 + 1 for i in range(70)], [(5 * i) % 50 + 3 for i in range(52)]]
    runs = {}
    for label, opts, fixed in (("eager", {}, False), ("fixed", {}, True), ("dense", None, False),
                               ("full", {"p1": 1.0, "p2": 1.0}, True)):
        policy = None if opts is None else make_policy("doublep", {**opts, "decoded": decoded, "window": 6,
                                                                   "cluster_size": 4, "dense_layers": 1})
        runner = Runner(model, 2, 110, policy, fixed=fixed)
        tokens, out = model.logits(runner.prefill(prompts)).argmax(-1), []
        for step in range(16):
            if step == 10:
                runner.truncate([n - 3 for n in runner.cache.lengths])
            tokens = runner.decode(tokens).argmax(-1)
            out.append(tokens.tolist())
        runs[label] = out
    assert runs["fixed"] == runs["eager"]
    assert runs["full"] == runs["dense"]


def test_rollback_moves_the_index_back_in_fixed_mode():
    keys = anisotropic_keys(2, 120, 16, seed=0).view(1, 2, 120, 16)
    cache = cache_with_keys(keys)
    policy = make_policy("binarypc", {"budget": 0.1, "dense_layers": 0, "encode_decoded": "true", "window": 4})
    policy.build(0, cache, [60])
    policy.plan_fixed(cache, [60])
    q = torch.randn(1, 4, 1, 16)
    for n in range(60, 80):  # fixed-width steps hash what leaves the window as they go
        policy.begin_step(torch.tensor([n]))
        policy.decode(0, q, cache, torch.tensor([n]))
    state = cache.policy_state[0]
    assert int(state.encoded_dev) == 79 - 4 + 1
    policy.append(0, cache, [65])  # rollback
    assert int(state.encoded_dev) == 65


@pytest.mark.parametrize("name,options", [("binarypc", {"budget": 0.1, "window": 2}), ("topk", {"budget": 9}),
                                          ("streaming", {"budget": 0.2}), ("quest", {"budget": 0.1, "page": 8})])
def test_a_reusing_step_attends_to_the_kept_selection_and_the_slots_decoded_since(name, options):
    """select_every: a selecting step keeps every layer's selection; each reusing step adds its query's slot to
    it and attends to exactly that set (checked against exact attention over the set)."""
    from sparsespec.attention.policy import attend_selected

    B, Hkv, S, D = 2, 2, 130, 16
    cache = cache_with_keys(anisotropic_keys(B * Hkv, S, D, seed=4).view(B, Hkv, S, D))
    lengths = [90, 61]
    policy = make_policy(name, {**options, "dense_layers": 0, "select_every": 4})
    policy.build(0, cache, lengths)
    policy.plan_fixed(cache, lengths)
    plan = policy.fixed
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor(lengths)
    policy.begin_step(positions)
    policy.decode(0, torch.randn(B, 2 * Hkv, 1, D, generator=g), cache, positions)
    idx, count = (t[0].clone() for t in plan.kept)
    selected = [idx[r, :count[r]].tolist() for r in range(B * Hkv)]
    plan.reusing = True
    for step in range(1, 4):
        positions = torch.tensor(lengths) + step
        q = torch.randn(B, 2 * Hkv, 1, D, generator=g)
        policy.begin_step(positions)
        got = policy.decode(0, q, cache, positions)
        idx, count = plan.kept[0][0], plan.kept[1][0]
        sets = []
        for r in range(B * Hkv):
            want = selected[r] + [lengths[r // Hkv] + i for i in range(1, step + 1)]
            assert idx[r, :count[r]].tolist() == want
            sets.append(want)
        width = max(map(len, sets))
        slots = torch.tensor([x + [0] * (width - len(x)) for x in sets]).view(B, Hkv, width)
        valid = torch.tensor([[True] * len(x) + [False] * (width - len(x)) for x in sets]).view(B, Hkv, width)
        assert torch.allclose(got, attend_selected(q, cache.k[0], cache.v[0], slots, valid), atol=1e-5, rtol=1e-4)
    plan.reusing = False
    policy.begin_step(positions + 1)  # a selecting step replaces the kept selection
    policy.decode(0, torch.randn(B, 2 * Hkv, 1, D, generator=g), cache, positions + 1)
    assert all(int(plan.kept[1][0][r]) <= plan.width for r in range(B * Hkv))


@torch.inference_mode()
def test_select_every_in_the_runner_selects_then_reuses_and_selects_again_after_a_rollback():
    from .test_spec import tiny_engine

    model = tiny_engine(0).model
    prompts = [list(range(1, 41)), [7] * 23]
    dense = Runner(model, 2, 80)
    full = Runner(model, 2, 80, make_policy("binarypc", {"budget": 1.0, "dense_layers": 0, "select_every": 3}))
    # every layer dense (no sparse layer keeps a selection): reusing steps are dense steps
    none = Runner(model, 2, 80, make_policy("binarypc", {"budget": 0.2, "dense_layers": 2, "select_every": 3}))
    small = Runner(model, 2, 80, make_policy("binarypc", {"budget": 0.2, "dense_layers": 0, "select_every": 3,
                                                          "min_tokens": 0}))
    assert full.fixed and small.fixed  # select_every needs the fixed-width path, on CPU too
    calls = []
    select = small.policy.fixed_selection
    small.policy.fixed_selection = lambda *a: calls.append(1) or select(*a)
    tokens = [r.model.logits(r.prefill(prompts)).argmax(-1) for r in (dense, full, small, none)]
    for step in range(7):
        tokens = [r.decode(t).argmax(-1) for r, t in zip((dense, full, small, none), tokens)]
        assert torch.equal(tokens[1], tokens[0])  # a full budget reused is still every token: dense greedy
        assert torch.equal(tokens[3], tokens[0])
    assert len(calls) == 2 * 3  # steps 0, 3, 6 select (two layers each); the others reuse
    small.truncate([n - 2 for n in small.cache.lengths])
    small.decode(tokens[2])
    assert len(calls) == 2 * 4  # a rollback: the next step selects again


@pytest.mark.parametrize("name,options", [
    ("binarypc", {"budget": 0.2, "window": 2}), ("topk", {"budget": 9, "sinks": 0, "window": 0}),
    ("streaming", {"budget": 0.2}), ("quest", {"budget": 0.2, "page": 4, "window": 0}),
    ("binarypc", {"budget": 0.3, "window": 3, "dense_layers": 1})])
@torch.inference_mode()
def test_a_sparse_verify_block_equals_decode_steps_that_reuse_its_first_selection(name, options):
    """`Runner.sparse_verify` (a cascade's sparse level): a block of w tokens in one pass gives the logits of w
    decode steps that select at the first token and reuse that selection (select_every = w), on the fixed-width
    path and the eager one alike, for rows of different lengths; lengths do not move. The budget is small enough
    that the pass is not the dense verify."""
    from sparsespec.errors import SparseSpecError
    from .test_spec import tiny_engine

    model = tiny_engine(0).model
    prompts = [list(range(1, 41)), [7] * 23 + [3, 9]]
    block = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    opts = {"dense_layers": 0, "min_tokens": 0, **options}
    steps = Runner(model, 2, 80, make_policy(name, {**opts, "select_every": 5}))
    fixed = Runner(model, 2, 80, make_policy(name, opts), fixed=True)
    eager = Runner(model, 2, 80, make_policy(name, opts), fixed=False, taps=(0,))
    dense = Runner(model, 2, 80)
    for r in (steps, fixed, eager, dense):
        r.prefill(prompts)
    lengths = list(steps.cache.lengths)
    want = torch.stack([steps.decode(block[:, i]) for i in range(5)], 1)  # [2, 5, V]
    for r in (fixed, eager):
        got, features = r.sparse_verify(block)
        assert r.cache.lengths == lengths
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert features.shape == (2, 5, model.cfg.hidden_size)
    assert not torch.allclose(dense.verify(block)[0], want, rtol=1e-3, atol=1e-3)
    with pytest.raises(SparseSpecError, match="selects keys for a block"):
        dense.sparse_verify(block)


@pytest.mark.parametrize("name,options,kernels", [
    ("binarypc", {"budget": 0.2, "window": 2}, False), ("streaming", {"budget": 0.2}, False),
    ("quest", {"budget": 0.2, "page": 4, "window": 0}, False), ("binarypc", {"budget": 0.2, "window": 2}, True),
    ("quest", {"budget": 0.2, "page": 4, "window": 0}, True)])
@torch.inference_mode()
def test_a_reusing_sparse_verify_block_equals_the_decode_steps_after_its_selecting_block(monkeypatch, name, options,
                                                                                          kernels):
    """select_every = 8: a selecting block of 4 at n (2 of its tokens kept), then a reusing block of 5 at n + 2 and
    one of 1 at n + 7 select nothing and attend to the first block's selection and the slots after it: the logits of
    decode steps over the same tokens that select at n and reuse that selection up to n + 7. The budget is small
    enough that a block selecting anew at n + 2 differs; in a block where one row reuses and the other selects,
    each row gets what it gets in a block of its kind (and its kept selection and position follow). `kernels`: the
    fixed-width steps and passes run the Triton kernels (interpreted here), as on CUDA."""
    import sparsespec.kernels
    from sparsespec.errors import SparseSpecError
    from .test_spec import tiny_engine

    calls = []
    if kernels and CUDA:
        pytest.skip("runs the kernels on CPU tensors (Triton's interpreter, set only without CUDA)")
    if kernels:
        from sparsespec.kernels import attend

        monkeypatch.setattr(sparsespec.kernels, "triton_ready", lambda device: True)
        kernel = attend.sparse_block_attention
        monkeypatch.setattr(attend, "sparse_block_attention", lambda *a: calls.append(a[-1]) or kernel(*a))

    model = tiny_engine(0).model
    prompts = [list(range(1, 41)), [7] * 23 + [3, 9]]
    opts = {"dense_layers": 0, "min_tokens": 0, "select_every": 8, **options}
    steps, blocks, mixed = (Runner(model, 2, 80, make_policy(name, opts)) for _ in range(3))
    fresh = Runner(model, 2, 80, make_policy(name, {**opts, "select_every": 1}), fixed=True)
    for r in (steps, blocks, mixed, fresh):
        r.prefill(prompts)
    n = list(blocks.cache.lengths)
    tokens = torch.tensor([[5, 6, 11, 12, 13, 14, 15, 16], [1, 2, 21, 22, 23, 24, 25, 26]])
    want = torch.stack([steps.decode(tokens[:, i]) for i in range(8)], 1)  # [2, 8, V]
    for r in (blocks, mixed, fresh):
        first, _ = r.sparse_verify(torch.tensor([[5, 6, 9, 9], [1, 2, 8, 8]]))
        torch.testing.assert_close(first[:, :2], want[:, :2], rtol=1e-4, atol=1e-4)
        r.truncate([x + 2 for x in n])
    second, _ = blocks.sparse_verify(tokens[:, 2:7], reuse=[True, True])
    torch.testing.assert_close(second, want[:, 2:7], rtol=1e-4, atol=1e-4)
    blocks.truncate([x + 7 for x in n])
    last, _ = blocks.sparse_verify(tokens[:, 7:], reuse=[True, True])
    torch.testing.assert_close(last[:, 0], want[:, 7], rtol=1e-4, atol=1e-4)
    anew, _ = fresh.sparse_verify(tokens[:, 2:7])
    assert not torch.allclose(anew, want[:, 2:7], rtol=1e-3, atol=1e-3)
    both, _ = mixed.sparse_verify(tokens[:, 2:7], reuse=[True, False])
    torch.testing.assert_close(both[0], want[0, 2:7], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[1], anew[1], rtol=1e-4, atol=1e-4)
    assert mixed.policy.fixed.selected_at.tolist() == [n[0], n[1] + 2]
    with pytest.raises(SparseSpecError, match="select_every > 1"):
        fresh.sparse_verify(tokens[:, 2:7], reuse=[True, False])
    assert not kernels or {3, 4, 7} <= set(calls)  # (spans: a selecting pass of 4, 5 anew; reusing, mixed: 7)


def test_select_every_is_validated():
    from sparsespec.errors import SparseSpecError
    from .test_spec import tiny_engine

    with pytest.raises(SparseSpecError, match="select_every must be >= 1"):
        make_policy("binarypc", {"select_every": 0})
    model = tiny_engine(0).model
    with pytest.raises(SparseSpecError, match="select_every needs the fixed-width steps"):
        Runner(model, 1, 32, make_policy("magicpig", {"select_every": 2}))
    with pytest.raises(SparseSpecError, match="select_every needs the fixed-width steps"):
        Runner(model, 1, 32, make_policy("binarypc", {"select_every": 2}), fixed=False)


@torch.inference_mode()
def test_verify_then_a_partial_commit_equals_decoding_the_committed_tokens():
    """A speculative step through the runner: a block verified at once gives the logits of decoding it token by
    token, its tapped features those of a prefill over the same tokens, and committing a prefix leaves the cache as
    if only that prefix had been decoded."""
    from .conftest import byte_engine

    model = byte_engine().model
    prompts = [list(b"speculative "), list(b"decoding verifies a block")]
    block = torch.tensor([list(b"abcdef"), list(b"ghijkl")])
    spec = Runner(model, 2, 64, taps=(0, 1))
    plain = Runner(model, 2, 64)
    spec.prefill(prompts, chunk=5)
    plain.prefill(prompts, chunk=5)
    lengths = list(spec.cache.lengths)
    logits, features = spec.verify(block)  # [2, 6, V], [2, 6, 2 * H]
    assert spec.cache.lengths == lengths  # nothing committed yet
    for i in range(block.shape[1]):
        torch.testing.assert_close(logits[:, i], plain.decode(block[:, i]), rtol=1e-5, atol=1e-5)
    whole = Runner(model, 2, 64, taps=(0, 1))
    _, prompt_features = whole.prefill_tapped([p + block[b].tolist() for b, p in enumerate(prompts)], chunk=7)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(features[b], prompt_features[b, n:n + 6], rtol=1e-5, atol=1e-5)
    spec.truncate([n + 3 for n in lengths])  # keep 3 of the block: the rest is rolled back ("not advanced")
    plain.truncate([n + 3 for n in lengths])
    nxt = torch.tensor([ord("x"), ord("y")])
    torch.testing.assert_close(spec.decode(nxt), plain.decode(nxt), rtol=1e-5, atol=1e-5)
    hidden = spec.forward(block[:, :2])  # a drafter catching up: hidden states, lengths kept
    assert hidden.shape[:2] == (2, 2) and spec.cache.lengths == [n + 4 for n in lengths]


def test_compiled_runs_size_their_cache_in_few_buckets_so_nearby_lengths_share_a_compilation(monkeypatch):
    """A compiled step is specialised to its cache's size: `bucket_capacity` rounds up to 2^k or 1.5 · 2^k (at most
    50% more, never past the model's context unless already there), and compiled dense generation and speculation
    allocate that size; plain (uncompiled) runs and sparse policies keep the exact size."""
    from sparsespec import generate as generate_module
    from sparsespec.runner import bucket_capacity
    from sparsespec.spec import decode as decode_module
    from sparsespec.spec.drafters import NgramDrafter

    from .test_spec import tiny_engine

    sizes = set()
    for n in range(1, 70_000, 7):
        c = bucket_capacity(n, 32_768)
        sizes.add(c)
        assert c == n if n >= 32_768 else n <= c <= min(32_768, max(256, n * 3 // 2 + 1)), (n, c)
    assert sorted(sizes)[:8] == [256, 384, 512, 768, 1024, 1536, 2048, 3072]
    assert len([s for s in sizes if s <= 32_768]) == 15

    made = []

    class Spy(Runner):
        def __init__(self, model, batch, capacity, *args, **kwargs):
            made.append(capacity)
            super().__init__(model, batch, capacity, *args, **kwargs)

    monkeypatch.setattr(generate_module, "Runner", Spy)
    monkeypatch.setattr(decode_module, "Runner", Spy)
    engine = tiny_engine(0)
    prompt = list(range(1, 40))
    for compile in (False, True):
        gen = GenerationConfig(max_new_tokens=5, compile=compile)
        engine.generate([prompt], gen)
        decode_module.speculative_generate(engine, [prompt], NgramDrafter(), gen, 4)
        engine.generate([prompt], gen, policy=make_policy("topk", {"budget": 0.5}))
    assert made == [44, 48, 44, 256, 256, 44]


def test_a_runner_pool_serves_a_loop_of_calls_with_one_runner_a_size_and_the_same_outputs(monkeypatch):
    """`RunnerPool`: dense generation and speculation over prompts of nearby lengths take one kept runner per
    (batch, bucketed capacity, taps) instead of a new one a call, emptied between calls, with the outputs of runs
    without the pool (greedy and sampled, the DFlash drafter reused across calls); sparse policies are not pooled."""
    from sparsespec import generate as generate_module
    from sparsespec import runner as runner_module
    from sparsespec.runner import RunnerPool
    from sparsespec.spec import decode as decode_module
    from sparsespec.spec.decode import speculative_generate
    from sparsespec.spec.dflash import DFlashDrafter

    from .test_spec import tiny_dflash, tiny_engine

    made = []

    class Spy(Runner):
        def __init__(self, model, batch, capacity, *args, **kwargs):
            made.append((batch, capacity))
            super().__init__(model, batch, capacity, *args, **kwargs)

    monkeypatch.setattr(generate_module, "Runner", Spy)
    monkeypatch.setattr(decode_module, "Runner", Spy)
    monkeypatch.setattr(runner_module, "Runner", Spy)  # the pool's own runners
    engine = tiny_engine(0)
    drafter = DFlashDrafter(tiny_dflash(engine, block=4), engine.model)
    pool = RunnerPool()
    prompts = [list(range(1, 40)), [5, 3] * 9, [7] * 61, list(range(2, 12))]
    for T in (0.0, 1.0):
        gen = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(temperature=T, seed=3))
        for batch in ([p] for p in prompts):
            plain = engine.generate(batch, gen)
            assert engine.generate(batch, gen, runners=pool).token_ids == plain.token_ids
            alone = speculative_generate(engine, batch, drafter, gen, 4)[0].token_ids
            assert speculative_generate(engine, batch, drafter, gen, 4, pool)[0].token_ids == alone
            if T == 0:
                assert alone == plain.token_ids[0]
        pair = [prompts[0], prompts[2]]  # a batch of two: its own runners
        assert engine.generate(pair, gen, runners=pool).token_ids == engine.generate(pair, gen).token_ids
    pooled = [m for m in made if m[1] == 256]
    assert sorted(set(pooled)) == [(1, 256), (2, 256)] and len(pooled) == 3  # plain, speculative (taps), the pair
    assert len(pool.runners) == 3
    before = len(made)
    engine.generate([prompts[0]], gen, runners=pool, policy=make_policy("topk", {"budget": 0.5}))
    assert made[before:] == [(1, 39 + 12)]  # sparse: a runner of its own, the exact size


def test_kept_graphs_are_reused_by_key_and_the_least_recently_used_is_dropped_first():
    from sparsespec.graphs import Kept

    made = []

    def make(key):
        made.append(key)
        return object()

    kept = Kept(size=2)
    a = kept.get("a", lambda: make("a"))
    b = kept.get("b", lambda: make("b"))
    assert kept.get("a", lambda: make("a")) is a  # kept, and now the most recently used
    c = kept.get("c", lambda: make("c"))  # drops b, the least recently used
    assert kept.get("a", lambda: make("a")) is a and kept.get("c", lambda: make("c")) is c
    assert kept.get("b", lambda: make("b")) is not b  # made again
    assert made == ["a", "b", "c", "b"] and len(kept.entries) == 2
    assert kept.get("a", lambda: make("a"), valid=lambda value: False) is not a  # no longer valid: made again
    assert made[-1] == "a" and len(kept.entries) == 2
    kept.clear()
    assert not kept.entries
