"""Self-speculation drafting with FP8 copies of the target's weights: the draft steps multiply with them (and only
the draft steps), the verify keeps the model's weights, so the output is still exactly plain greedy decoding."""

import pytest
import torch

from sparsespec.errors import SparseSpecError
from sparsespec.generate import GenerationConfig
from sparsespec.models import transformer
from sparsespec.runner import Runner
from sparsespec.spec.bench import make_drafter
from sparsespec.spec.decode import speculative_generate

from .test_spec import self_drafter, tiny_engine

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7] * 30, list(range(1, 50)), [5, 4]]


def counting(monkeypatch) -> list[int]:
    """Count the FP8 products the model makes (rows of each)."""
    calls = []
    real = transformer.fp8_linear
    monkeypatch.setattr(transformer, "fp8_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    return calls


def test_a_drafting_linear_multiplies_with_its_fp8_copy_and_only_then(monkeypatch):
    torch.manual_seed(0)
    model = tiny_engine(0).model
    x = torch.randn(3, 5, model.cfg.hidden_size)
    lin = model.layers[0].mlp.gate_up_proj
    with pytest.raises(RuntimeError, match="fp8_drafts"):
        with model.drafting():
            pass
    model.fp8_drafts()
    assert lin.fp8_weight.dtype == torch.float8_e4m3fn and lin.fp8_scale.shape == (lin.out_features,)
    calls = counting(monkeypatch)
    plain = lin(x)
    assert not calls
    with model.drafting():
        drafted = lin(x)
    assert calls == [15] and not lin.drafting  # reset on leaving
    assert not torch.equal(drafted, plain)  # another product...
    err = (drafted - plain).abs().max() / plain.abs().max()
    assert err < 0.05, err  # ...of weights within FP8's precision
    assert torch.equal(lin(x), plain)


@torch.inference_mode()
def test_the_runner_drafts_with_fp8_weights_and_verifies_with_the_models(monkeypatch):
    target = tiny_engine(0, vocab=128)
    runner = Runner(target.model, len(PROMPTS), 120, self_drafter("binarypc").policy)
    runner.prefill(PROMPTS)
    first = torch.tensor([1, 2, 3, 4])
    lengths = list(runner.cache.lengths)
    plain = runner.decode(first)
    runner.truncate(lengths)
    runner.fp8_decode()
    calls = counting(monkeypatch)
    drafted = runner.decode(first)
    layers = target.model.cfg.num_layers
    assert calls == [len(PROMPTS)] * (4 * layers + 1)  # q/k/v, o, gate/up, down a layer, and the LM head
    assert not torch.equal(drafted, plain) and (drafted - plain).abs().max() < 0.1 * plain.abs().max()
    calls.clear()
    runner.truncate(lengths)
    runner.verify(torch.stack([first, first], 1))
    assert not calls  # the verify: the model's own weights


@pytest.mark.parametrize("block", [3, 6])
def test_greedy_self_speculation_with_fp8_drafts_is_plain_greedy(block, monkeypatch):
    target = tiny_engine(0, vocab=128)
    gen = GenerationConfig(max_new_tokens=30)
    drafter = self_drafter("binarypc")
    drafter.fp8 = True
    calls = counting(monkeypatch)
    out = speculative_generate(target, PROMPTS, drafter, gen, block)
    assert calls  # the drafts went through the FP8 copies
    assert [o.token_ids for o in out] == target.generate(PROMPTS, gen).token_ids
    assert sum(o.tau for o in out) / len(out) > 1.5  # and the drafts are still mostly accepted


def test_the_self_drafter_spec_takes_a_weights_option():
    target = tiny_engine(0)
    drafter = make_drafter("self:binarypc:budget=0.1,weights=fp8", target, "tiny")
    assert drafter.fp8 and drafter.policy.options.budget == 0.1
    assert not make_drafter("self:binarypc:weights=model", target, "tiny").fp8
    assert not make_drafter("self:binarypc", target, "tiny").fp8
    for bad in ("self:binarypc:weights=int4", "self:binarypc:weights=fp8,weights=model"):
        with pytest.raises(SparseSpecError, match="weights=W takes fp8"):
            make_drafter(bad, target, "tiny")
