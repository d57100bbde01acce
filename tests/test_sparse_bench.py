"""The GPU benchmarks' host-side pieces (the timed parts need CUDA: tests/test_cuda.py, docs/results/)."""

import pytest

from sparsespec.errors import SparseSpecError
from sparsespec.sparse_bench import text_rows


def words(text: str) -> dict:
    """A tokenizer stand-in: one id per whitespace-separated word."""
    return {"input_ids": [hash(w) % 1000 for w in text.split()]}


def test_text_rows_gives_each_row_its_own_text_of_the_length_asked():
    rows = text_rows(words, "wiki", batch=3, tokens=517)
    assert [len(r) for r in rows] == [517] * 3
    assert len({tuple(r) for r in rows}) == 3  # each row its own seeded run of documents


def test_text_rows_refuses_a_corpus_too_short(monkeypatch):
    monkeypatch.setattr("sparsespec.corpora.text", lambda corpus, words, seed: "only five words in here")
    with pytest.raises(SparseSpecError, match="fewer than 6"):
        text_rows(words, "wiki", batch=1, tokens=6)
