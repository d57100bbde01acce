"""RULER-style tasks and the eval harness on the real default model's tokenizer and weights."""

import json

import pytest
import torch

from sparsespec.attention import make_policy
from sparsespec.eval.harness import EvalConfig, parse_length, perplexity, report, run_eval
from sparsespec.eval.tasks import TASKS, TaskBuilder, score


@pytest.fixture(scope="module")
def builder(smollm2_engine):
    return TaskBuilder(smollm2_engine.tokenizer)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [1024, 3000])
def test_tasks_are_deterministic_sized_and_answerable(builder, task, length):
    a, b = builder.sample(task, length, 7), builder.sample(task, length, 7)
    assert a == b
    assert builder.sample(task, length, 8).prompt != a.prompt
    n = builder.n_tokens(a.prompt)
    assert abs(n - length) <= 0.02 * length, n
    assert all(ans in a.prompt for ans in a.answers) and a.answers


def test_needle_depth_is_swept(builder):
    depths = {builder.sample("niah_single", 1024, i).depth for i in range(15)}
    assert depths == {0.0, 0.25, 0.5, 0.75, 1.0}


def test_score_is_the_share_of_answers_found():
    assert score("The numbers are 12 and 34.", ("12", "34", "56")) == pytest.approx(2 / 3)
    assert score("APPLE", ("apple",)) == 1.0


def test_parse_length():
    assert parse_length("4k") == 4096 and parse_length("8192") == 8192 and parse_length(" 2K ") == 2048


@pytest.mark.slow
def test_eval_shares_prefill_resumes_and_full_budget_matches_dense(smollm2_engine, tmp_path):
    cfg = EvalConfig(tasks=("niah_single", "vt"), lengths=(512,), samples=2,
                     policies=("dense", "topk:budget=1.0,dense_layers=0"))
    rows = run_eval(smollm2_engine, cfg, tmp_path)
    assert len(rows) == 8
    by = {(r["task"], r["sample"], r["policy"]): r for r in rows}
    for task in ("niah_single", "vt"):
        for i in range(2):
            dense, sparse = by[task, i, "dense"], by[task, i, "topk:budget=1.0,dense_layers=0"]
            assert dense["output"] == sparse["output"] and 0 <= dense["score"] <= 1
    assert run_eval(smollm2_engine, cfg, tmp_path) == rows  # a rerun finds everything done
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8 and {"task", "length", "policy", "sample", "score", "tokens_attended"} <= set(
        json.loads(lines[0]))
    table = report(rows, [], tmp_path, "test")
    assert "niah_single" in table and (tmp_path / "accuracy.png").is_file()


@pytest.mark.slow
def test_perplexity_through_a_full_budget_policy_equals_dense(smollm2_engine):
    ids = smollm2_engine.tokenizer("The history of the city goes back to Roman times. " * 20)["input_ids"][:150]
    dense = perplexity(smollm2_engine, None, ids, 120)
    full = perplexity(smollm2_engine, make_policy("topk", {"budget": "1.0", "dense_layers": "0"}), ids, 120)
    sparse = perplexity(smollm2_engine, make_policy("streaming", {"budget": "8", "dense_layers": "0"}), ids, 120)
    assert dense == pytest.approx(full, rel=1e-4)
    assert 1 < dense < 100 and torch.isfinite(torch.tensor(sparse)) and sparse != pytest.approx(dense, rel=1e-4)
