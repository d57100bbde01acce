"""Long-generation quality metrics (eval/longgen.py) on a tiny random model: each against a direct computation."""

import pytest
import torch

from sparsespec.attention import make_policy
from sparsespec.eval.longgen import dense_nll, distinct, teacher_forced_agreement
from sparsespec.generate import GenerationConfig

from .test_spec import tiny_engine


def test_distinct_counts_unique_ngrams():
    assert distinct([1, 2, 3, 4], 2) == 1.0
    assert distinct([5, 5, 5, 5, 5], 2) == 0.25  # one 2-gram, four times
    assert distinct([1, 2, 1, 2, 1, 2], 2) == 2 / 5
    assert distinct([7], 4) == 1.0


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [3, 256])
def test_dense_nll_is_the_full_forwards(chunk):
    engine = tiny_engine(0)
    g = torch.Generator().manual_seed(1)
    prompt, text = torch.randint(1, 64, (20,), generator=g).tolist(), torch.randint(1, 64, (11,), generator=g).tolist()
    got = dense_nll(engine, prompt, text, chunk=chunk)
    tokens = torch.tensor([prompt + text])
    hidden = engine.model(tokens, torch.arange(tokens.shape[1])[None], _cache(engine, tokens.shape[1]))
    logp = torch.log_softmax(engine.model.logits(hidden[0, len(prompt) - 1:-1]), -1)
    want = -logp.gather(-1, torch.tensor(text)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(got), want, atol=1e-4)


def _cache(engine, capacity):
    from sparsespec.cache import KVCache

    return KVCache(engine.config, 1, capacity, torch.float32, "cpu")


@torch.inference_mode()
def test_teacher_forced_agreement_is_one_for_dense_attention_and_counts_misses():
    engine = tiny_engine(0)
    prompt = list(range(1, 40))
    text = engine.generate([prompt], GenerationConfig(max_new_tokens=12, stop_on_eos=False)).token_ids[0]
    assert teacher_forced_agreement(engine, None, prompt, text) == 1.0
    full = make_policy("topk", {"budget": 1.0, "dense_layers": 0})
    assert teacher_forced_agreement(engine, full, prompt, text) == 1.0
    wrong = [(t + 1) % 64 for t in text]  # never the argmax
    assert teacher_forced_agreement(engine, make_policy("topk", {"budget": 1.0, "dense_layers": 0}), prompt,
                                    wrong) == 0.0


def test_longgen_refuses_bad_options_in_one_line(capsys):
    from sparsespec.cli import main

    assert main(["longgen", "--kinds", "code"]) == 2
    assert main(["longgen", "--attention", "nosuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--kinds takes" in err[0] and "unknown attention policy" in err[1]


def test_long_essay_prompts_ask_for_an_essay_on_a_document_of_the_context():
    from sparsespec.spec.prompts import make_prompts

    prompts = make_prompts(3, "heldout", ("long-essay",), seed=2, long_chars=5000)
    assert [p.text for p in prompts] == [p.text for p in make_prompts(3, "heldout", ("long-essay",), 2, 5000)]
    for p in prompts:
        body, request = p.text.rsplit("\n\n", 1)
        assert p.kind == "long-essay" and len(body) <= 5000 + 200
        assert "essay" in request or "report" in request
