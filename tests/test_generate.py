"""Generation: greedy parity with HF generate, batching, sampling filters, stop conditions."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsespec import corpora
from sparsespec.errors import SparseSpecError
from sparsespec.generate import GenerationConfig, TextStream, held_back
from sparsespec.sampling import SamplingConfig, filter_logits, make_generator, sample

from .conftest import byte_engine


@pytest.mark.slow
def test_greedy_64_tokens_match_hf_generate(smollm2_engine, smollm2_hf):
    prompt = smollm2_engine.encode("Explain in detail how a steam engine works, step by step.", chat=True)
    ours = smollm2_engine.generate([prompt], GenerationConfig(max_new_tokens=64, stop_on_eos=False))
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert ours.token_ids[0] == ref[0, len(prompt):].tolist()
    assert len(ours.token_ids[0]) == 64


@pytest.mark.slow
def test_batched_generation_equals_one_by_one(smollm2_engine):
    """Three prompts of different lengths (20, 136 and 52 tokens, prefilled together in chunks of 32 positions)
    decoded together: each row's 12 greedy tokens are the ones it gets alone."""
    eng = smollm2_engine
    prompts = [eng.encode(corpora.text("wiki", n, seed=n)) for n in (7, 90, 33)]
    assert len({len(p) for p in prompts}) == 3
    gen = GenerationConfig(max_new_tokens=12, stop_on_eos=False, prefill_chunk=32)
    batched = eng.generate(prompts, gen)
    for i, p in enumerate(prompts):
        assert batched.token_ids[i] == eng.generate([p], gen).token_ids[0]


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_seed_dependent(smollm2_engine):
    eng = smollm2_engine
    prompt = eng.encode("Once upon a time")
    runs = [eng.generate([prompt], GenerationConfig(max_new_tokens=10, stop_on_eos=False, sampling=SamplingConfig(
        temperature=1.0, top_k=50, top_p=0.95, seed=s))).token_ids[0] for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.slow
def test_stop_string_cuts_text(smollm2_engine):
    eng = smollm2_engine
    prompt = eng.encode("Count: 1, 2, 3, 4, 5,")
    free = eng.generate([prompt], GenerationConfig(max_new_tokens=16, stop_on_eos=False))
    stop = free.texts[0].strip()[:3]
    stopped = eng.generate([prompt], GenerationConfig(max_new_tokens=16, stop_on_eos=False, stop_strings=(stop,)))
    assert stop not in stopped.texts[0]
    assert len(stopped.token_ids[0]) < len(free.token_ids[0])


@pytest.mark.parametrize("stops", [(), ("日本",), ("Köln!",), ("ça va?", "🎉 日")])
def test_text_stream_shows_stable_text_up_to_a_stop_string(smollm2_engine, stops):
    """Token by token (characters split across tokens): the pieces never hold a partial character, a stop string
    or anything past it, and join to the text the whole ids decode to, cut before the first stop string (the first
    "Köln" is held back while it may begin "Köln!", then shown)."""
    tok = smollm2_engine.tokenizer
    ids = tok("Grüße aus Köln 🎉 日本語, ça va? Köln! Tschüss")["input_ids"]
    whole = tok.decode(ids, skip_special_tokens=True)
    final = whole[: min([whole.index(s) for s in stops], default=len(whole))]
    stream, pieces = TextStream(tok, stops), []
    for t in ids:
        stream.add(t)
        pieces.append(stream.take())
        if stream.cut is not None:
            break
    assert not any("\ufffd" in p for p in pieces) and sum(map(bool, pieces)) > 5
    assert "".join(pieces) == final[: len("".join(pieces))]
    assert "".join(pieces) + stream.take(final=final) == final
    if stops:
        assert "".join(pieces) == final  # stopped: nothing was held back


@pytest.mark.slow
def test_streamed_text_equals_final_text(smollm2_engine):
    """`on_text` pieces, handed out while a batch generates (non-ASCII output, characters split across tokens),
    join to exactly each row's final text."""
    eng = smollm2_engine
    prompts = [eng.encode(p) for p in ("日本の首都は", "Emoji story: 🎉🎈", "Grüße aus Köln! Die Stadt")]
    pieces: list[list[str]] = [[] for _ in prompts]
    result = eng.generate(prompts, GenerationConfig(max_new_tokens=8, stop_on_eos=False, stop_strings=("ll",)),
                          on_text=lambda b, text: pieces[b].append(text))
    for b, text in enumerate(result.texts):
        assert "".join(pieces[b]) == text and "ll" not in text
    assert any(len(p) > 2 for p in pieces)  # shown as generated, not at the end


def test_streamed_text_equals_final_text_on_broken_utf8(one_thread):
    """A random model on a byte tokenizer: split and invalid UTF-8 everywhere, rows ending mid-character."""
    eng = byte_engine()
    prompts = [list("Grüße aus Köln 🎉".encode()), list("日本の首都は".encode()), [200]]
    for stops in ((), ("e", "\ufffd\ufffd")):
        pieces: list[list[str]] = [[] for _ in prompts]
        gen = GenerationConfig(max_new_tokens=64, sampling=SamplingConfig(temperature=1.0, seed=0), stop_strings=stops)
        result = eng.generate(prompts, gen, on_text=lambda b, text: pieces[b].append(text))
        assert ["".join(p) for p in pieces] == result.texts


def test_text_is_detokenised_incrementally_only_where_something_reads_it(one_thread, monkeypatch):
    """Without `on_text` and stop strings the rows' text is decoded once at the end (no per-token detokenisation
    between decode steps), and is the same text the streamed run shows; a stop string or a reader turns the
    incremental text back on."""
    eng = byte_engine()
    prompts = [list("Grüße aus Köln 🎉".encode()), list("abc".encode())]
    calls = []
    real = TextStream.add
    monkeypatch.setattr(TextStream, "add", lambda self, token: calls.append(token) or real(self, token))
    gen = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0, seed=3))
    quiet = eng.generate(prompts, gen)
    assert not calls
    pieces: list[list[str]] = [[] for _ in prompts]
    shown = eng.generate(prompts, gen, on_text=lambda b, text: pieces[b].append(text))
    assert calls and shown.token_ids == quiet.token_ids and shown.texts == quiet.texts
    assert ["".join(p) for p in pieces] == quiet.texts
    calls.clear()
    cut = eng.generate(prompts, GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0, seed=3),
                                                 stop_strings=("e",)))
    assert calls and all("e" not in text for text in cut.texts)


def test_chat_system_message(smollm2_engine):
    eng = smollm2_engine
    with_system = eng.tokenizer.decode(eng.encode("Say hi.", chat=True, system="Answer in French."))
    assert "Answer in French." in with_system and with_system.endswith("Say hi.<|im_end|>\n<|im_start|>assistant\n")
    assert "Answer in French." not in eng.tokenizer.decode(eng.encode("Say hi.", chat=True))


def test_prompt_longer_than_context_is_refused(smollm2_engine):
    n = smollm2_engine.config.max_position
    with pytest.raises(SparseSpecError, match="exceeds the model's context"):
        smollm2_engine.generate([[1] * (n - 3)], GenerationConfig(max_new_tokens=4))


def test_greedy_is_argmax():
    logits = torch.randn(5, 37)
    assert torch.equal(sample(logits, SamplingConfig(), None), logits.argmax(-1))


def _reference_filter(row: torch.Tensor, cfg: SamplingConfig) -> tuple[set[int], dict[int, float]]:
    """The kept set by definition, in float64: top-k by value, then every token whose higher-ranked tokens hold
    less than top-p of the probability mass. Also each top-k token's preceding mass."""
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    if cfg.top_k:
        order = order[: cfg.top_k]
    probs = torch.softmax(row[order].double() / cfg.temperature, 0).tolist()
    before, mass = {}, 0.0
    for i, p in zip(order, probs):
        before[i] = mass
        mass += p
    return {i for i, m in before.items() if m < cfg.top_p}, before


@settings(max_examples=80, deadline=None)
@given(st.integers(2, 40), st.integers(0, 45), st.floats(0.05, 1.0), st.floats(0.3, 2.0), st.integers(0, 10**6))
def test_top_k_top_p_keep_the_defined_set(vocab, top_k, top_p, temperature, seed):
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3
    kept = set(torch.nonzero(torch.isfinite(filter_logits(row[None], cfg)[0])).flatten().tolist())
    ref, before = _reference_filter(row, cfg)
    assert kept <= set(before) and len(kept) >= 1
    for token in kept ^ ref:
        # only a token whose preceding mass sits on the top-p boundary may differ (fp32 vs fp64 rounding)
        assert abs(before[token] - top_p) < 1e-5, (token, kept, ref)


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_top_p_below_the_top_token_s_probability_keeps_the_top_token_alone(top_p):
    """A valid top_p below float32's range rounds to 0 against the probabilities: the first token is kept all the
    same (it used to drop every token, and sampling failed)."""
    logits = torch.randn(3, 41, generator=torch.Generator().manual_seed(5)) * 2
    cfg = SamplingConfig(temperature=1.0, top_p=top_p, seed=0)
    kept = torch.isfinite(filter_logits(logits, cfg))
    assert torch.equal(kept, torch.nn.functional.one_hot(logits.argmax(-1), 41).bool())
    assert torch.equal(sample(logits, cfg, make_generator(cfg, "cpu")), logits.argmax(-1))


def test_a_temperature_too_small_to_divide_by_is_greedy():
    logits = torch.randn(5, 37) * 30
    cfg = SamplingConfig(temperature=1e-300, seed=0)
    assert torch.equal(sample(logits, cfg, make_generator(cfg, "cpu")), logits.argmax(-1))


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
                                 dict(seed=2**64), dict(seed=-2**63 - 1)])
def test_invalid_sampling_options(bad):
    with pytest.raises(SparseSpecError):
        SamplingConfig(**bad)


@given(st.text("ab", max_size=12), st.text("ab", min_size=1, max_size=12))
def test_a_stream_holds_back_the_longest_end_that_begins_a_stop_string(text, stop):
    """`held_back` against its definition: the longest end of the text, shorter than the stop string, that the stop
    string begins with (two letters: ends overlap often)."""
    assert held_back(text, stop) == max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def test_an_empty_stop_string_is_refused():
    from sparsespec.errors import SparseSpecError

    with pytest.raises(SparseSpecError, match="stop string must not be empty"):
        GenerationConfig(stop_strings=("###", ""))


def _api_calls():
    from sparsespec.attention import make_policy
    from sparsespec.generate import Engine
    from sparsespec.spec.decode import speculative_generate

    g = GenerationConfig(max_new_tokens=2)
    return {
        "a flat list of ids": (lambda e, ids: e.generate(ids, g), "wrap it in a list"),
        "a text prompt": (lambda e, ids: e.generate(["Hello"], g), "a prompt must be a list of token ids"),
        "an id past the vocabulary": (lambda e, ids: e.generate([ids, [256]], g),
                                      r"prompt 2 of 2: token ids must be in \[0, 256\)"),
        "a negative id": (lambda e, ids: e.generate([[-1, 5]], g), r"must be in \[0, 256\).*got -1"),
        "a policy's name": (lambda e, ids: e.generate([ids], g, policy="binarypc"), "make_policy"),
        "no drafter": (lambda e, ids: speculative_generate(e, [ids], None, g), "drafter must be a Drafter"),
        "a fractional block": (lambda e, ids: speculative_generate(e, [ids], None, g, 2.5), "block size"),
        "fractional new tokens": (lambda e, ids: GenerationConfig(max_new_tokens=2.5), "max_new_tokens must be"),
        "sampling as a dict": (lambda e, ids: GenerationConfig(sampling={"temperature": 1}), "SamplingConfig"),
        "a fractional top-k": (lambda e, ids: SamplingConfig(temperature=1, top_k=2.5), "top_k must be a whole"),
        "a fractional seed": (lambda e, ids: SamplingConfig(temperature=1, seed=1.5), "seed must be a whole"),
        "a temperature as text": (lambda e, ids: SamplingConfig(temperature="1"), "temperature must be a number"),
        "a fractional int option": (lambda e, ids: make_policy("binarypc", {"bits": 2.5}), "it takes ints"),
        "a bool budget": (lambda e, ids: make_policy("binarypc", {"budget": True}), "it takes floats"),
        "an unknown device": (lambda e, ids: Engine.from_name("smollm2-135m", device="gpu"), "unknown device 'gpu'"),
        "no model name": (lambda e, ids: Engine.from_name(""), "name a model"),
    }


@pytest.mark.parametrize("case", list(_api_calls()))
def test_the_library_refuses_what_it_cannot_use_in_one_clear_error(case, one_thread):
    call, needle = _api_calls()[case]
    engine = byte_engine()
    with pytest.raises(SparseSpecError, match=needle):
        call(engine, engine.encode("Hello"))


def test_one_stop_string_or_id_stands_for_itself_and_an_empty_batch_gives_nothing(one_thread):
    import numpy as np

    gen = GenerationConfig(max_new_tokens=2, stop_strings="of", stop_token_ids=np.int64(5))
    assert gen.stop_strings == ("of",) and gen.stop_token_ids == (5,)  # not the strings "o" and "f"
    engine = byte_engine()
    assert engine.generate([], gen).texts == []
