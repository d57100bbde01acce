"""RULER-style tasks and the eval harness on the real default model's tokenizer and weights."""

import json
import math

import pytest
import torch

from sparsespec import corpora
from sparsespec.attention import make_policy
from sparsespec.attention.policy import SelectionOptions, select_top
from sparsespec.errors import SparseSpecError
from sparsespec.eval.harness import EvalConfig, parse_length, perplexity, report, run_eval, run_perplexity
from sparsespec.eval.tasks import TASKS, TaskBuilder, score

from .conftest import cache_with_keys


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


def _by_key(rows):
    return {(r["task"], r["sample"], r["policy"]): r for r in rows}


@pytest.mark.slow
def test_batched_eval_equals_one_by_one_resumes_and_full_budget_matches_dense(smollm2_engine, tmp_path):
    # two tasks of short answers (niah_single: 24 new tokens at most, qa: 16), prompts of 256 tokens (the rows of
    # a batch 255 and 256 long): every row decodes through both policies twice (alone, batched), and the real
    # model's prefills and decode steps are what this test's time goes to
    policies = ("dense", "topk:budget=1.0,dense_layers=0")
    cfg = EvalConfig(tasks=("niah_single", "qa"), lengths=(256,), samples=2, policies=policies, batch=1)
    alone = run_eval(smollm2_engine, cfg, tmp_path / "alone")
    assert len(alone) == 8
    by = _by_key(alone)
    for task in cfg.tasks:
        for i in range(2):
            dense, sparse = by[task, i, "dense"], by[task, i, policies[1]]
            assert dense["output"] == sparse["output"] and 0 <= dense["score"] <= 1
            assert sparse["tokens_attended"] > dense["prompt_tokens"]

    # Batched, in two runs: dense for niah_single's sample 0 first, then one batch per task: niah_single's, in which
    # sample 0 lacks only topk, and qa's, which lacks every row.
    out = tmp_path / "batched"
    first = run_eval(smollm2_engine, EvalConfig(tasks=cfg.tasks[:1], lengths=(256,), samples=1,
                                                policies=("dense",)), out)
    assert len(first) == 1
    rows = run_eval(smollm2_engine, EvalConfig(tasks=cfg.tasks, lengths=(256,), samples=2, policies=policies,
                                               batch=2), out)
    assert rows[:1] == first and len(rows) == 8 and _by_key(rows) == by  # per-row tokens_attended included
    assert run_eval(smollm2_engine, cfg, out) == rows  # a rerun finds everything done
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8 and {"task", "length", "policy", "sample", "score", "tokens_attended"} <= set(
        json.loads(lines[0]))
    table = report(rows, [], out, "test")
    assert "niah_single" in table and (out / "accuracy.png").is_file()


def test_report_means_only_cells_every_policy_finished(tmp_path):
    def row(task, policy, sample, score):
        return {"task": task, "length": 4096, "policy": policy, "sample": sample, "score": score,
                "tokens_attended": 10}

    rows = [row("niah_single", p, i, s) for p, s in (("dense", 1.0), ("topk:budget=0.5", 0.5)) for i in range(2)]
    rows += [row("vt", "dense", 0, 0.0)]  # vt lacks topk: left out of both policies' means
    table = report(rows, [], tmp_path, "t")
    assert "| **mean** (1 complete tasks) | 4096 | 1.00 / 10 (n=2) | 0.50 / 10 (n=2) |" in table
    assert "| vt | 4096 | 0.00 / 10 (n=1) | - |" in table and (tmp_path / "accuracy.png").is_file()
    rows += [row("vt", "topk:budget=0.5", 0, 1.0)]
    assert "| **mean** | 4096 | 0.67 / 10 (n=3) | 0.67 / 10 (n=3) |" in report(rows, [], tmp_path, "t")


def test_batch_options_are_validated():
    for bad in ({"batch": 0}, {"perplexity_rows": 0}, {"perplexity_tokens": -1}):
        with pytest.raises(SparseSpecError, match=next(iter(bad)).replace("_", " ")):
            EvalConfig(**bad)


def test_perplexity_tokens_are_checked_against_the_lengths_before_any_work():
    with pytest.raises(SparseSpecError, match=r"perplexity tokens \(5000\) must be below the shortest length \(2048\)"):
        EvalConfig(lengths=(8192, 2048), perplexity_tokens=5000)
    with pytest.raises(SparseSpecError, match=r"0 \(none\) or >= 2"):
        EvalConfig(perplexity_tokens=1)  # a window's last token predicts nothing


@pytest.mark.slow
def test_batched_perplexity_pools_rows_and_a_full_budget_policy_equals_dense(smollm2_engine, tmp_path):
    tok = smollm2_engine.tokenizer
    # 120 tokens prefilled, 8 predicted per row (each a decode step of the real model) in each of five runs
    rows = [tok(corpora.text("wiki", 300, seed))["input_ids"][:129] for seed in (1, 2)]
    dense = perplexity(smollm2_engine, None, rows, 120)
    alone = [perplexity(smollm2_engine, None, [r], 120) for r in rows]
    assert dense == pytest.approx(math.sqrt(alone[0] * alone[1]), rel=1e-4)  # equal counts: geometric mean
    full = perplexity(smollm2_engine, make_policy("topk", {"budget": "1.0", "dense_layers": "0"}), rows, 120)
    streaming = make_policy("streaming", {"budget": "8", "dense_layers": "0", "min_tokens": "0"})
    sparse = perplexity(smollm2_engine, streaming, rows, 120)
    assert dense == pytest.approx(full, rel=1e-4)
    assert 1 < dense < 100 and math.isfinite(sparse) and sparse != pytest.approx(dense, rel=1e-4)

    cfg = EvalConfig(lengths=(160,), policies=("dense",), perplexity_tokens=8, perplexity_rows=2)
    got = run_perplexity(smollm2_engine, cfg, tmp_path)
    assert len(got) == 1 and got[0]["rows"] == 2 and 1 < got[0]["perplexity"] < 100
    assert run_perplexity(smollm2_engine, cfg, tmp_path) == got


@pytest.mark.parametrize("name,options", [
    ("topk", {}), ("streaming", {}), ("quest", {"page": "4"}), ("magicpig", {"window": "2", "min_collisions": "0"}),
    ("binarypc", {"bits": "8", "sinks": "2"}), ("twilight", {"candidates": "0.5"}),
])
def test_stepping_selects_what_reading_positions_back_selects(name, options):
    g = torch.Generator().manual_seed(7)
    cache = cache_with_keys(torch.randn(3, 2, 90, 16, generator=g))
    budget = {"budget": "0.2"} if name != "twilight" else {}  # (twilight: its candidates' budget)
    policy = make_policy(name, {**budget, "dense_layers": "0", "min_tokens": "0", **options})
    lengths = [70, 41, 88]  # the harness's rows: different lengths, each querying at its own
    policy.build(0, cache, [n - 5 for n in lengths])
    policy.append(0, cache, lengths)
    q, positions = torch.randn(3, 4, 1, 16, generator=g), torch.tensor(lengths)
    idx, valid = policy.select(0, q, cache, positions)
    with policy.stepping(lengths):
        idx_stepped, valid_stepped = policy.select(0, q, cache, positions)
    for b in range(3):
        for h in range(2):
            assert idx[b, h][valid[b, h]].tolist() == idx_stepped[b, h][valid_stepped[b, h]].tolist()


def test_selection_ties_go_to_the_lower_slot_whatever_the_width():
    # a batch selects up to its largest budget: a row's own top slots must not depend on that width
    scores = torch.randn(2, 3, 300, generator=torch.Generator().manual_seed(1)).round()  # many ties, -0.0 too
    positions, opts = torch.tensor([299, 150]), SelectionOptions(budget=0.1, min_tokens=0)
    reference = scores.clone()
    reference[0, :, 299] = reference[1, :, 150] = float("inf")  # the current token is forced in
    reference[1, :, 151:] = float("-inf")
    want = reference.sort(dim=-1, descending=True, stable=True).indices
    for forced in ([0, 0], [40, 40], [300, 300]):
        idx, valid = select_top(scores, positions, opts, positions.tolist(), forced)
        for b, n in enumerate([30, 15]):  # the budgets
            assert torch.equal(idx[b][valid[b]].view(3, n), want[b, :, :n])


def test_a_length_too_short_for_a_task_is_refused_not_overrun(builder):
    """A task's least prompt (its needles and question) longer than the length asked: refused, where it was built
    longer and reported under the length asked."""
    with pytest.raises(SparseSpecError, match="too short for this task"):
        builder.sample("niah_single", 16, 0)
    assert builder.n_tokens(builder.sample("niah_single", 400, 0).prompt) <= 400
