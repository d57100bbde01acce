"""Long-generation quality metrics (eval/longgen.py) on a tiny random model: each against a direct computation."""

import pytest
import torch

from sparsespec.attention import make_policy
from sparsespec.eval.longgen import dense_scores, distinct, report, teacher_forced_agreement
from sparsespec.generate import GenerationConfig

from .test_spec import tiny_engine


def test_distinct_counts_unique_ngrams():
    assert distinct([1, 2, 3, 4], 2) == 1.0
    assert distinct([5, 5, 5, 5, 5], 2) == 0.25  # one 2-gram, four times
    assert distinct([1, 2, 1, 2, 1, 2], 2) == 2 / 5
    assert distinct([7], 4) == 1.0


@torch.inference_mode()
@pytest.mark.parametrize("chunk", [3, 256])
def test_dense_scores_are_the_full_forwards(chunk):
    """The chunked pass's per-token loss equals one forward's; its departures are the steps where the forward's
    argmax is not the text's token, each with its log-probability margin; dense's own greedy text has none, and
    that text with one token changed departs there (and, past it, wherever the changed context changes the argmax)."""
    engine = tiny_engine(0)
    g = torch.Generator().manual_seed(1)
    prompt, text = torch.randint(1, 64, (20,), generator=g).tolist(), torch.randint(1, 64, (11,), generator=g).tolist()
    got, departures = dense_scores(engine, prompt, text, chunk=chunk)

    def forward(text):
        tokens = torch.tensor([prompt + text])
        hidden = engine.model(tokens, torch.arange(tokens.shape[1])[None], _cache(engine, tokens.shape[1]))
        return torch.log_softmax(engine.model.logits(hidden[0, len(prompt) - 1:-1]), -1)  # [len(text), V]

    logp = forward(text)
    own = logp.gather(-1, torch.tensor(text)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(got), -own, atol=1e-4)
    best, choice = logp.max(-1)
    assert [i for i, _ in departures] == (choice != torch.tensor(text)).nonzero()[:, 0].tolist()
    assert all(abs(m - float(best[i] - own[i])) < 1e-4 and m > 0 for i, m in departures)
    greedy = engine.generate([prompt], GenerationConfig(max_new_tokens=11, stop_on_eos=False)).token_ids[0]
    assert dense_scores(engine, prompt, greedy, chunk=chunk)[1] == []
    changed = greedy[:5] + [(greedy[5] + 1) % 64] + greedy[6:]
    assert dense_scores(engine, prompt, changed, chunk=chunk)[1][0][0] == 5


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


def _row(prompt, policy, ppl, keys=None, departures=None):
    row = {"prompt": prompt, "kind": "long-code", "prompt_tokens": 100, "policy": policy, "generated": 8,
           "dense_ppl": ppl, "distinct2": 1.0, "distinct4": 1.0, "agreement": 0.5, "first_divergence": 3,
           "keys": keys, "tokens": [1] * 8}
    return row if departures is None else {**row, "departures": departures}


def test_report_compares_policies_on_the_prompts_every_policy_finished(tmp_path):
    rows = [_row(0, "dense", 1.0), _row(0, "topk", 2.0, 10), _row(1, "dense", 1.0), _row(1, "topk", 4.0, 30),
            _row(2, "dense", 9.0)]  # a stopped run: prompt 2 lacks topk, so it is left out for dense too
    table = report(rows, tmp_path, "t")
    assert "| dense | 2 | 8 | 1.00 |" in table and "| topk | 2 | 8 | 3.00 |" in table and "| 20 |" in table
    assert (tmp_path / "longgen.md").read_text() == table and (tmp_path / "longgen.png").is_file()
    assert "| 3 | - | 20 |" in table  # rows from before departures were recorded
    rows = [_row(0, "dense", 1.0, departures=[]), _row(0, "topk", 2.0, 10, [[7, 0.02], [14, 0.14]]),
            _row(1, "dense", 1.0, departures=[]), _row(1, "topk", 4.0, 30, [])]
    table = report(rows, None, "t")
    assert "| 3 | 0.0 | all |" in table and "| 3 | 1.0 (<= 0.14) | 20 |" in table


def test_longgen_report_renders_a_folder_without_a_model(capsys, tmp_path, monkeypatch):
    import json

    from sparsespec.cli import main
    from sparsespec.generate import Engine

    rows = [_row(0, "dense", 1.0), _row(0, "topk", 2.0, 10), _row(0, "quest", 3.0, 10), _row(5, "topk", 1.0, 10)]
    (tmp_path / "longgen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "longgen.settings.json").write_text(json.dumps(
        {"model": "m", "dtype": "bfloat16", "device": "cuda", "kinds": ["long-code"], "prompts": 2, "long_chars": 12000,
         "max_new_tokens": 512, "seed": 0}))
    monkeypatch.setattr(Engine, "from_name", lambda *a, **k: pytest.fail("--report loaded a model"))
    argv = ["longgen", "--report", "--out", str(tmp_path), "--kinds", "long-code", "--prompts", "2"]
    assert main([*argv, "--attention", "topk"]) == 0
    table = capsys.readouterr().out
    assert "m (real weights, bfloat16, cuda)" in table and "| topk | 1 |" in table and "quest" not in table
    assert main([*argv, "--attention", "topk", "--max-new-tokens", "64"]) == 2  # other settings than recorded
    assert "other settings (max_new_tokens)" in capsys.readouterr().err


def test_longgen_resumes_its_rows_and_refuses_rows_of_other_prompts(tmp_path):
    import json

    from sparsespec.errors import SparseSpecError
    from sparsespec.eval.longgen import LongGenConfig, run_longgen

    from .conftest import byte_engine

    engine = byte_engine()
    cfg = LongGenConfig(policies=("topk:budget=0.5",), kinds=("long-code",), prompts=1, long_chars=1000,
                        max_new_tokens=8)
    rows = run_longgen(engine, cfg, tmp_path)
    assert [r["policy"] for r in rows] == ["dense", "topk:budget=0.5"] and rows[0]["agreement"] == 1.0
    assert len({r["prompt_digest"] for r in rows}) == 1 and all(len(r["tokens"]) <= 8 for r in rows)
    assert run_longgen(engine, cfg, tmp_path) == rows  # resumed: nothing recomputed
    path = tmp_path / "longgen.jsonl"
    path.write_text("".join(json.dumps(r | {"prompt_digest": "0" * 16}) + "\n" for r in rows))
    with pytest.raises(SparseSpecError, match="other prompts"):
        run_longgen(engine, cfg, tmp_path)
