"""Policies inside the engine on the real default model: full budget = dense, bounded budgets, CLI, calibration."""

import functools

import pytest
import torch

from sparsespec import corpora
from sparsespec.attention import POLICIES, make_policy
from sparsespec.attention.binarypc import BinaryPC, BinaryPCOptions
from sparsespec.attention.policy import SelectionOptions
from sparsespec.cli import main
from sparsespec.errors import SparseSpecError
from sparsespec.eval.fidelity import FidelityConfig, run_fidelity
from sparsespec.generate import Engine, GenerationConfig

from .conftest import cache_with_keys
from .test_binarypc import anisotropic_keys

NO_CALIBRATION = [name for name in POLICIES if name not in ("dense", "doublesparse")]


@pytest.fixture(scope="module")
def prompt(smollm2_wiki_greedy):
    return smollm2_wiki_greedy[0]


@pytest.fixture(scope="module")
def dense_tokens(smollm2_wiki_greedy):  # 20 tokens
    return smollm2_wiki_greedy[1]


@pytest.mark.slow
@pytest.mark.parametrize("name", NO_CALIBRATION)
def test_full_budget_reproduces_dense_greedy(smollm2_engine, prompt, dense_tokens, name):
    options = {"dense_layers": "0"}
    if issubclass(POLICIES[name].Options, SelectionOptions):  # (the top-p policies take no budget)
        options["budget"] = "1.0"
    if name == "magicpig":  # its collision filter drops keys whatever the budget; 0 makes every key a candidate
        options["min_collisions"] = "0"
    if name == "doublep":
        options.update(p1="1.0", p2="1.0")
    if name in ("topp", "twilight"):
        options.update(p="1.0")
    if name == "twilight":
        options.update(candidates="1.0")
    policy = make_policy(name, options)
    out = smollm2_engine.generate([prompt], GenerationConfig(max_new_tokens=20, stop_on_eos=False), policy=policy)
    assert out.token_ids[0] == dense_tokens


@pytest.mark.slow
def test_full_budget_doublesparse_reproduces_dense_greedy(smollm2_engine, prompt, dense_tokens, tmp_path,
                                                          monkeypatch):
    def session_engine(name, device, dtype, progress):  # the model calibrate loads: the session's (it only reads it)
        assert (name, device, dtype) == ("smollm2-135m", "cpu", "float32")
        return smollm2_engine

    monkeypatch.setattr(Engine, "from_name", staticmethod(session_engine))
    labels = tmp_path / "labels.safetensors"
    assert main(["calibrate", "doublesparse", "--tokens", "256", "--channels", "8", "--out", str(labels)]) == 0
    options = {"budget": "1.0", "dense_layers": "0", "labels": str(labels), "channels": "8"}
    policy = make_policy("doublesparse", options)
    out = smollm2_engine.generate([prompt], GenerationConfig(max_new_tokens=20, stop_on_eos=False), policy=policy)
    assert out.token_ids[0] == dense_tokens


@pytest.mark.slow
def test_batched_sparse_generation_equals_one_by_one(smollm2_engine):
    """Two prompts of different lengths (117 and 217 tokens) decoded together under BinaryPC at 10% give each the
    tokens it gets alone: each row's basis fit, selection budget and forced slots are its own. min_tokens=0 and a
    small window: the default floor (1024 keys) and window (64) would attend every key of these prompts."""
    eng = smollm2_engine
    prompts = [eng.tokenizer(corpora.text("wiki", n, seed=n))["input_ids"] for n in (70, 150)]
    gen = GenerationConfig(max_new_tokens=8, stop_on_eos=False)
    options = {"budget": "0.1", "min_tokens": "0", "sinks": "2", "window": "4"}
    batched = eng.generate(prompts, gen, policy=make_policy("binarypc", options))
    for i, p in enumerate(prompts):
        alone = eng.generate([p], gen, policy=make_policy("binarypc", options))
        assert batched.token_ids[i] == alone.token_ids[0]


def test_encode_decoded_keeps_the_unhashed_tail_within_the_window():
    keys = anisotropic_keys(2, 200, 16, seed=0).view(1, 2, 200, 16)
    cache = cache_with_keys(keys)
    grow = BinaryPC(BinaryPCOptions(dense_layers=0, budget=0.05))
    bounded = BinaryPC(BinaryPCOptions(dense_layers=0, budget=0.05, encode_decoded=True, window=8))
    q = torch.randn(1, 4, 1, 16)
    for policy in (grow, bounded):
        policy.build(0, cache, [100])
        for n in range(101, 181):
            policy.append(0, cache, [n])
    assert cache.policy_state[0].encoded == [173]  # the bounded policy ran last: (172, 180] is the window
    idx, valid = bounded.select(0, q, cache, torch.tensor([180]))
    assert int(valid.sum(-1).max()) == bounded.options.tokens(181)  # window (8) inside the budget (9): bounded
    grow.build(0, cache, [100])
    for n in range(101, 181):
        grow.append(0, cache, [n])
    idx, valid = grow.select(0, q, cache, torch.tensor([180]))
    chosen = set(idx[0, 0][valid[0, 0]].tolist())
    assert set(range(100, 181)) <= chosen  # every decoded token is attended when decoded tokens are not hashed


def test_rollback_forgets_codes():
    cache = cache_with_keys(anisotropic_keys(2, 64, 8, seed=1).view(1, 2, 64, 8))
    policy = BinaryPC(BinaryPCOptions(dense_layers=0, encode_decoded=True, window=0))  # every decoded token encoded
    policy.build(0, cache, [40])
    policy.append(0, cache, [50])
    assert cache.policy_state[0].encoded == [50]
    policy.append(0, cache, [45])
    assert cache.policy_state[0].encoded == [45]


@pytest.mark.parametrize("options,needle", [
    ({"nope": "1"}, "unknown attention option"), ({"budget": "x"}, "invalid value"), ({"budget": "0"}, "budget"),
    ({"budget": "2.5"}, "integer"), ({"bits": "0"}, "bits"), ({"safeguard": "1.5"}, "safeguard"),
    ({"encode_decoded": "maybe"}, "invalid value"), ({"basis": "/nonexistent.safetensors"}, "not found"),
])
def test_invalid_policy_options(options, needle):
    with pytest.raises(SparseSpecError, match=needle):
        make_policy("binarypc", options)


def test_unknown_policy_through_cli(capsys):
    assert main(["generate", "--prompt", "x", "--attention", "nonsense"]) == 2
    assert "unknown attention policy" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--attention", "topk", "--attention-opt", "bits=3"]) == 2
    assert "unknown attention option 'bits'" in capsys.readouterr().err


@pytest.mark.slow
def test_calibrated_basis_round_trip(tmp_path, capsys, monkeypatch):
    # the three commands load the same model alike: from its file once, then from this test's memo
    monkeypatch.setattr(Engine, "from_name", staticmethod(functools.cache(Engine.from_name)))
    basis = tmp_path / "basis.safetensors"
    assert main(["calibrate", "binarypc", "--tokens", "200", "--bits", "16", "--out", str(basis)]) == 0
    code = main(["generate", "--prompt", "The capital of France is", "--max-new-tokens", "4", "--attention",
                 "binarypc", "--attention-opt", "bits=16", f"basis={basis}", "dense_layers=0", "--json"])
    assert code == 0, capsys.readouterr().err
    code = main(["generate", "--prompt", "x", "--max-new-tokens", "2", "--attention", "binarypc",
                 "--attention-opt", "bits=32", f"basis={basis}"])
    assert code == 2 and "holds a 16-bit basis and the policy asks for 32 bits: pass bits=16" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_fidelity_is_exact_at_full_budget_and_orders_methods(smollm2_engine):
    cfg = FidelityConfig(length=256, contexts=("natural",), budgets=(1.0, 0.1),
                         policies=("topk", "streaming", "topp:p=1.0"), options=("topk.min_tokens=0",
                                                                              "streaming.min_tokens=0"), steps=2)
    rows = {(r["policy"], r["budget"]): r for r in run_fidelity(smollm2_engine.model, smollm2_engine.tokenizer, cfg)}
    assert [k for k in rows if k[0].startswith("topp")] == [("topp:p=1.0", None)]  # no budget: one run
    assert rows["topp:p=1.0", None]["mass_recall"] > 0.9999
    for name in ("topk", "streaming"):
        assert rows[name, 1.0]["mass_recall"] > 0.9999 and rows[name, 1.0]["output_error"] < 1e-4
    assert rows["topk", 0.1]["mass_recall"] >= rows["streaming", 0.1]["mass_recall"]
    assert rows["topk", 0.1]["mass_recall"] < 1
