"""`sparsespec serve` as a real process driven through the official `openai` client: completions and chat, streamed
and not, greedy (and seeded) outputs equal to `generate` alone also under concurrency, bad input answered with the
OpenAI error object while the server keeps serving, a full queue refused at once, disconnects freeing their slots,
Prometheus metrics, and SIGTERM finishing the request in flight."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sparsespec import corpora
from sparsespec.errors import SparseSpecError
from sparsespec.generate import GenerationConfig
from sparsespec.runner import Runner
from sparsespec.sampling import SamplingConfig, make_generator, sample, sample_rows
from sparsespec.serve.scheduler import Job, Scheduler, SchedulerConfig

from .conftest import byte_engine

MODEL = "smollm2-135m"
# small chunks: the test prompts (up to ~110 tokens) are prefilled in several chunks between decode steps
MAX_BATCH, MAX_QUEUE, MAX_CONTEXT, PREFILL_CHUNK = 4, 8, 1024, 32


def test_prefill_row_fills_one_row_and_leaves_the_others(one_thread):
    model = byte_engine().model
    runner = Runner(model, 3, 64)
    runner.prefill([list(range(1, 20)), list(range(30, 35)), list(range(40, 52))])
    before = [(k.clone(), v.clone()) for k, v in zip(runner.cache.k, runner.cache.v)]
    prompt = list(range(60, 77))
    for start in range(0, len(prompt), 5):  # chunked, as the scheduler prefills
        hidden = runner.prefill_row(1, prompt[start:start + 5], start)
    assert runner.cache.lengths == [19, 17, 12]
    alone = Runner(model, 1, 64)
    want = alone.prefill([prompt], chunk=5)[0]
    assert torch.equal(hidden, want)
    for (k0, v0), k, v, ka, va in zip(before, runner.cache.k, runner.cache.v, alone.cache.k, alone.cache.v):
        for row in (0, 2):  # untouched, bit for bit
            assert torch.equal(k[row], k0[row]) and torch.equal(v[row], v0[row])
        assert torch.equal(k[1, :, :17], ka[0, :, :17]) and torch.equal(v[1, :, :17], va[0, :, :17])


def test_decode_rows_steps_a_prefix_of_the_rows_and_leaves_the_others(one_thread):
    model = byte_engine().model
    prompts = [list(range(1, 20)), list(range(30, 35)), list(range(40, 52))]
    runner, two = Runner(model, 3, 64), Runner(model, 2, 64)
    runner.prefill(prompts)
    two.prefill(prompts[:2])
    row2 = (runner.cache.k[0][2].clone(), runner.cache.v[0][2].clone())
    tokens = torch.tensor([7, 9])
    assert torch.equal(runner.decode_rows(tokens), two.decode(tokens))
    assert runner.cache.lengths == [20, 6, 12]
    assert torch.equal(runner.cache.k[0][2], row2[0]) and torch.equal(runner.cache.v[0][2], row2[1])


def test_scheduler_interleaves_prefill_chunks_with_decode_steps(one_thread):
    """A long prompt joins while another request decodes: its chunks alternate with the batch's decode steps, and
    both requests get what `generate` gives each alone."""
    engine = byte_engine()
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=2, max_context=256, prefill_chunk=8))
    calls = []
    for name in ("prefill_row_tapped", "decode_rows"):
        method = getattr(scheduler.runner, name)
        setattr(scheduler.runner, name, lambda *a, _m=method, _n=name: calls.append(_n.removesuffix("_tapped"))
                or _m(*a))
    gen = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    short, long = engine.encode("Hello"), engine.encode("A much longer prompt, of sixty-odd bytes, to prefill.")
    events = {0: [], 1: []}
    started, finished = threading.Event(), threading.Event()

    def deliver(k):
        def on(event):  # (the scheduler thread)
            events[k].append(event)
            started.set()
            if all(e and e[-1].finish_reason for e in events.values()):
                finished.set()
        return on

    scheduler.start()
    try:
        scheduler.submit(Job(short, gen, deliver(0)))
        assert started.wait(30)
        scheduler.submit(Job(long, gen, deliver(1)))
        assert finished.wait(60)
    finally:
        scheduler.stop()
    chunks = -(-len(long) // 8)
    assert calls.count("prefill_row") == 1 + chunks
    first = calls.index("prefill_row", 1)
    window = calls[first:first + 2 * chunks]
    assert window == ["prefill_row", "decode_rows"] * chunks  # a chunk per iteration, the running row decodes on
    for k, prompt in ((0, short), (1, long)):
        assert "".join(e.text for e in events[k]) == engine.generate([prompt], gen).texts[0]
        assert events[k][-1].finish_reason == "length" and events[k][-1].completion_tokens == 24


def test_a_request_whose_set_up_fails_ends_alone_and_the_scheduler_serves_on(one_thread, monkeypatch):
    """A request whose own set-up raises (here its sampler's generator) ends with an error event; the requests
    around it are answered as `generate` answers them alone, and the scheduler stays healthy."""
    from sparsespec.serve import scheduler as module

    engine = byte_engine()
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=1, max_context=256, prefill_chunk=16))
    make = module.make_generator

    def fragile(sampling, device):
        if sampling.seed == 13:
            raise RuntimeError("no generator today")
        return make(sampling, device)

    monkeypatch.setattr(module, "make_generator", fragile)
    gen = GenerationConfig(max_new_tokens=6, stop_on_eos=False)
    bad = GenerationConfig(max_new_tokens=6, stop_on_eos=False, sampling=SamplingConfig(temperature=1.0, seed=13))
    prompts = [engine.encode("one"), engine.encode("two"), engine.encode("three")]
    events, alive = serve_events(scheduler, list(zip(prompts, (gen, bad, gen))))
    assert alive and events[1][-1].finish_reason == "error" and "no generator today" in events[1][-1].error
    for k in (0, 2):
        assert "".join(e.text for e in events[k]) == engine.generate([prompts[k]], gen).texts[0]
        assert events[k][-1].finish_reason == "length"


def serve_all(scheduler: Scheduler, prompts: list[list[int]], gen: GenerationConfig) -> list[str]:
    """Submit every prompt at once to a started-here scheduler (more requests than slots: they queue), wait for
    all to finish, stop it -> each request's whole text."""
    events, _ = serve_events(scheduler, [(prompt, gen) for prompt in prompts])
    return ["".join(e.text for e in events[k]) for k in range(len(prompts))]


def serve_events(scheduler: Scheduler, requests: list[tuple[list[int], GenerationConfig]]):
    """`serve_all` of (prompt, settings) requests -> (each request's events, whether the scheduler was still
    alive when the last one ended)."""
    events = {k: [] for k in range(len(requests))}
    finished = threading.Event()

    def deliver(k):
        def on(event):  # (the scheduler thread)
            events[k].append(event)
            if all(e and e[-1].finish_reason for e in events.values()):
                finished.set()
        return on

    scheduler.start()
    try:
        for k, (prompt, gen) in enumerate(requests):
            scheduler.submit(Job(prompt, gen, deliver(k)))
        assert finished.wait(120)
        alive = scheduler.alive
    finally:
        scheduler.stop()
    return events, alive


@pytest.mark.parametrize("spec", ["binarypc:budget=0.3,min_tokens=4,sinks=2,window=4,dense_layers=0",
                                  "quest:budget=0.3,min_tokens=4,sinks=0,window=0,page=4,dense_layers=0",
                                  "streaming:budget=0.3,min_tokens=4,dense_layers=0"])
def test_scheduler_with_a_sparse_policy_gives_each_request_what_it_gets_alone(one_thread, spec):
    """Rows join, prefill and leave at different times; each row's index is built as its prompt completes (the
    other rows' kept, a freed slot's rebuilt): every answer equals `generate` of its prompt alone, same policy."""
    from sparsespec.attention import make_policy, parse_spec

    engine = byte_engine()
    policy = lambda: make_policy(parse_spec(spec)[0], parse_spec(spec)[1])  # noqa: E731
    scheduler = Scheduler(engine, SchedulerConfig(max_batch=2, max_context=256, prefill_chunk=16), policy())
    texts = ["The quick brown fox jumps over the lazy dog, twice.", "Hello", "Sparse attention, served: a longer "
             "prompt of some seventy bytes to fill a few pages.", "abc abc abc abc abc"]
    prompts = [engine.encode(t) for t in texts]
    gen = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    texts_served = serve_all(scheduler, prompts, gen)
    for k, prompt in enumerate(prompts):
        alone = engine.generate([prompt], gen, policy=policy()).texts[0]
        assert texts_served[k] == alone, (k, spec)
        assert alone != engine.generate([prompt], gen).texts[0]  # the policy changes what the model says here


@pytest.mark.parametrize("drafter", ["ngram", "self", "model", "dflash", "tree", "lookup", "cascade"])
def test_scheduler_speculates_for_each_request_what_it_gets_alone(one_thread, drafter):
    """Continuous batching with a drafter: rows start drafting as their prompts complete and leave mid-step; each
    greedy answer equals plain `generate`, each seeded sampled one the speculative loop's answer for the prompt
    alone."""
    from sparsespec.attention import make_policy
    from sparsespec.spec.cascade import Cascade
    from sparsespec.spec.decode import speculative_generate
    from sparsespec.spec.dflash import DFlash, DFlashConfig, DFlashDrafter
    from sparsespec.spec.drafters import LookupFirst, ModelDrafter, NgramDrafter, SelfDrafter

    engine = byte_engine()

    def make():
        if drafter == "ngram":
            return NgramDrafter(max_n=3, min_n=1)
        if drafter == "self":
            return SelfDrafter(make_policy("binarypc", {"budget": 0.3, "min_tokens": 4, "dense_layers": 0}))
        if drafter == "model":
            return ModelDrafter(byte_engine(seed=1))
        torch.manual_seed(5)
        model = DFlash(DFlashConfig(engine.config, layers=1, block_size=4, taps=(0, 1)))
        dflash = DFlashDrafter(model.eval().requires_grad_(False), engine.model)
        dflash.tree_nodes = 5 if drafter == "tree" else 0  # a tree verify, greedy and sampled rows alike
        if drafter == "cascade":  # DFlash proposes to the sparse target, whose kept tokens the dense one verifies
            policy = make_policy("binarypc", {"budget": 0.3, "min_tokens": 4, "dense_layers": 0})
            return Cascade(dflash, policy, "c")
        return LookupFirst(dflash, min_n=2, min_tokens=1) if drafter == "lookup" else dflash

    texts = ["abc abc abc abc abc abc", "Hello", "The cat sat on the mat. The cat sat on the", "xyzxyzxyz"]
    prompts = [engine.encode(t) for t in texts]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=3)):
        gen = GenerationConfig(max_new_tokens=18, stop_on_eos=False, sampling=sampling)
        scheduler = Scheduler(engine, SchedulerConfig(max_batch=2, max_context=128, prefill_chunk=16, block_size=4),
                              drafter=make())
        steps = []
        speculate = scheduler._speculate
        scheduler._speculate = lambda: steps.append(sum(s is not None and s.decoding for s in scheduler.slots)) \
            or speculate()  # rows a step verifies
        texts_served = serve_all(scheduler, prompts, gen)
        for k, prompt in enumerate(prompts):
            alone = (engine.generate([prompt], gen).texts[0] if sampling.greedy else
                     speculative_generate(engine, [prompt], make(), gen, 4)[0].text)
            assert texts_served[k] == alone, (k, drafter, sampling)
        # (an untrained DFlash drafter proposes noise)
        if sampling.greedy and drafter not in ("dflash", "tree", "cascade"):
            assert sum(steps) < 4 * 17  # proposals were accepted: fewer row-steps than tokens after the first


@pytest.mark.parametrize("argv,needle", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--max-batch", "0"], "expected a positive integer"),
    (["--max-request-bytes", "0"], "expected a positive integer"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    (["--attention", "magicpig"], "serve runs graphable attention policies"),
    (["--attention", "doublep"], "serve runs graphable attention policies with a per-row index"),
    (["--attention", "binarypc:select_every=4"], "serve selects keys at every step"),
    (["--attention-opt", "budget=0.1"], "--attention-opt needs a sparse --attention policy"),
    (["--attention", "binarypc", "--attention-opt", "bits=0"], "bits must be in"),
    (["--attention", "streaming", "--draft", "ngram"], "--draft with a sparse --attention policy"),
    (["--draft", "ngram", "--block-size", "1"], "--block-size must be >= 2"),
    (["--block-size", "4"], "--block-size applies to speculative decoding"),
    (["--target-name", "qwen2.5-coder-0.5b", "--draft", "self:topk"], "--draft self:topk uses none"),
    (["--target-name", "qwen2.5-coder-0.5b"], "give --draft"),
])
def test_serve_refuses_bad_options_before_loading(capsys, argv, needle):
    from sparsespec.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_what_the_library_would_refuse_is_a_400_naming_its_field_and_a_tiny_temperature_is_greedy(one_thread):
    from fastapi.testclient import TestClient

    from sparsespec.serve.app import ServeConfig, create_app

    app = create_app(byte_engine(), ServeConfig("m", SchedulerConfig(max_batch=2, max_context=256)))
    ok = {"model": "m", "prompt": "hi", "max_tokens": 4}
    with TestClient(app) as client:
        for bad, param, message in (
                ({"stop": [""]}, "stop.0", "String should have at least 1 character"),
                ({"stop": ""}, "stop", "String should have at least 1 character"),  # (the str member is meant)
                ({"stop": "x" * 1025}, "stop", "String should have at most 1024 characters"),
                ({"stop": ["a", "x" * 1025]}, "stop.1", "String should have at most 1024 characters"),
                ({"seed": 2**64}, "seed", "Input should be less than 18446744073709551616"),
                ({"seed": -2**63 - 1}, "seed", "Input should be greater than or equal to -9223372036854775808")):
            _bad(client.post("/v1/completions", json={**ok, **bad}), param, f"{param}: {message}")
        for fine in ({"stop": "x" * 1024}, {"seed": 2**64 - 1}, {"seed": -2**63}):  # the edges are taken
            assert client.post("/v1/completions", json={**ok, **fine}).status_code == 200
        greedy = client.post("/v1/completions", json={**ok, "temperature": 0}).json()["choices"][0]["text"]
        resp = client.post("/v1/completions", json={**ok, "temperature": 1e-30, "seed": 1})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == greedy


@pytest.fixture
def byte_client(one_thread):
    """The app over the byte engine, served as "m" (in-process: no model to load)."""
    from fastapi.testclient import TestClient

    from sparsespec.serve.app import ServeConfig, create_app

    engine = byte_engine()
    with TestClient(create_app(engine, ServeConfig("m", SchedulerConfig(max_batch=2, max_context=256)))) as client:
        client.engine = engine
        yield client


BYTE_OK = {"model": "m", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("body", [b'{"model": "m", "prompt": "\xff\xfe", "max_tokens": 2}',  # not UTF-8
                                  b"[" * 100_000 + b"]" * 100_000])  # nested past the JSON reader's depth
def test_a_body_the_json_reader_gives_up_on_is_invalid_json(byte_client, body):
    resp = byte_client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json", resp.text
    assert byte_client.post("/v1/completions", json=BYTE_OK).status_code == 200


def test_a_body_over_the_size_limit_is_a_413_before_it_is_read_sized_or_chunked(one_thread):
    from fastapi.testclient import TestClient

    from sparsespec.serve.app import ServeConfig, create_app

    limit = 600
    app = create_app(byte_engine(), ServeConfig("m", SchedulerConfig(max_batch=2, max_context=256),
                                                max_request_bytes=limit))
    fits = json.dumps({**BYTE_OK, "prompt": "x" * 40, "user": "u" * 400}).encode()
    over = json.dumps({**BYTE_OK, "prompt": "x" * 40, "user": "u" * 600}).encode()
    assert len(fits) <= limit < len(over)
    headers = {"Content-Type": "application/json"}

    def chunked(body: bytes):  # no Content-Length: the body arrives in pieces
        return iter([body[i:i + 100] for i in range(0, len(body), 100)])

    with TestClient(app) as client:
        for content in (over, chunked(over)):
            resp = client.post("/v1/completions", content=content, headers=headers)
            assert resp.status_code == 413, resp.text
            error = resp.json()["error"]
            assert error["code"] == "request_too_large" and str(limit) in error["message"]
        edge = json.dumps({**BYTE_OK, "user": "u" * (limit - len(json.dumps({**BYTE_OK, "user": ""})))}).encode()
        assert len(edge) == limit
        for content in (fits, chunked(fits), edge, chunked(edge)):  # up to the limit: answered as ever
            resp = client.post("/v1/completions", content=content, headers=headers)
            assert resp.status_code == 200, resp.text
        assert client.get("/health").status_code == 200
    with pytest.raises(SparseSpecError, match="at least 1 byte"):
        ServeConfig("m", SchedulerConfig(), max_request_bytes=0)


@pytest.mark.parametrize("headers, status", [([(b"content-length", b"10")], 200),  # (a fitting, true length)
                                             ([(b"transfer-encoding", b"chunked")], 413),
                                             ([(b"content-length", b"10"), (b"transfer-encoding", b"chunked")], 413)])
def test_the_body_limit_counts_a_chunked_body_even_beside_a_content_length(headers, status):
    """HTTP servers frame a body that has both headers by its chunks (h11 does), so its Content-Length says nothing:
    the limit counts what arrives. Driven as ASGI directly, as the HTTP server would."""
    from sparsespec.serve.app import BodyLimit

    read = []

    async def app(scope, receive, send):  # reads the whole body, then answers 200
        while True:
            message = await receive()
            read.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    body = b"x" * 10 if status == 200 else b"x" * 5000
    chunks = [{"type": "http.request", "body": body[i:i + 100], "more_body": i + 100 < len(body)}
              for i in range(0, len(body), 100)]
    sent = []

    async def receive():
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
    asyncio.run(BodyLimit(app, limit=100)(scope, receive, send))
    assert sent[0]["status"] == status
    assert b"".join(read) == (body if status == 200 else b"")  # refused: the app read nothing


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def _bad(resp, param, message):
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["param"], error["message"]) == (param, message), error


@pytest.mark.parametrize("path,body,param,message", [
    # a union field: the member that got inside the value is named, not only "should be a valid string"
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url":
                                                                                {"url": "http://x/a.png"}}]}]},
     "messages.0.content.0.type", "messages.0.content.0.type: Input should be 'text'"),
    ("/v1/completions", {**BYTE_OK, "prompt": [5, -1]}, "prompt.1",
     "prompt.1: Input should be greater than or equal to 0"),
    ("/v1/completions", {**BYTE_OK, "stop": [1]}, "stop.0", "stop.0: Input should be a valid string"),
    ("/v1/completions", {**BYTE_OK, "prompt": 5}, "prompt",
     "prompt: Input should be a valid string or Input should be a valid list"),
    ("/v1/completions", {**BYTE_OK, "prompt": ["one", "two"]}, "prompt",
     "prompt: a list of prompts is not supported (send one prompt per request)"),
    # NaN and infinities are not numbers a sampler can use
    ("/v1/completions", {**BYTE_OK, "temperature": float("nan")}, "temperature",
     "temperature: Input should be a finite number"),
    ("/v1/completions", {**BYTE_OK, "top_p": float("inf")}, "top_p", "top_p: Input should be a finite number"),
    # text that is not Unicode (a lone surrogate, which JSON can spell) is refused, not a 500 from the tokenizer
    ("/v1/completions", {**BYTE_OK, "prompt": "a\ud800b"}, "prompt",
     "prompt: the text is not valid Unicode (a lone surrogate)"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\udc00"}]}, "messages.0.content",
     "messages.0.content: the text is not valid Unicode (a lone surrogate)"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text", "messages.0.content.0.text: the text is not valid Unicode (a lone surrogate)"),
    # as OpenAI: stream_options belong to streamed requests
    ("/v1/completions", {**BYTE_OK, "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options are only allowed when stream is true"),
    ("/v1/chat/completions", {**CHAT, "stream": False, "stream_options": {"include_usage": True}}, "stream_options",
     "stream_options are only allowed when stream is true"),
    # null for a required field is not its absence
    ("/v1/completions", {**BYTE_OK, "model": None}, "model", "model: Input should be a valid string"),
])
def test_bad_fields_are_named_with_a_clear_message(byte_client, path, body, param, message):
    # (json.dumps, as Python clients send: NaN, Infinity and lone surrogates escaped as "\ud800")
    _bad(byte_client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"}), param,
         message)
    assert byte_client.post("/v1/completions", json=BYTE_OK).status_code == 200


@pytest.mark.parametrize("content,headers,message", [
    (json.dumps(BYTE_OK), {"Content-Type": "text/plain"},
     "the request body must be JSON sent with Content-Type: application/json"),
    (json.dumps(BYTE_OK), {"Content-Type": "application/x-www-form-urlencoded"},  # curl -d's default
     "the request body must be JSON sent with Content-Type: application/json"),
    (b"", {"Content-Type": "application/json"}, "the request body is empty: send a JSON object"),
    (b"[1, 2]", {"Content-Type": "application/json"}, "the request body must be a JSON object"),
    (b"null", {"Content-Type": "application/json"}, "the request body must be a JSON object"),
])
def test_a_body_that_is_not_a_json_object_is_a_clear_400(byte_client, content, headers, message):
    for path in ("/v1/completions", "/v1/chat/completions"):
        _bad(byte_client.post(path, content=content, headers=headers), None, message)


def test_a_top_p_below_float32s_range_keeps_the_top_token_and_the_server_serves_on(byte_client):
    """top_p 1e-300 is valid (in (0, 1]); compared with float32 probabilities it rounded to 0, every token was
    dropped, sampling failed and took the scheduler (and so every later request) down. It keeps the top token, as
    any top_p below the top token's probability does."""
    greedy = byte_client.post("/v1/completions", json={**BYTE_OK, "max_tokens": 6})
    for top_p in (1e-300, 1e-45):
        resp = byte_client.post("/v1/completions", json={**BYTE_OK, "max_tokens": 6, "temperature": 1.0,
                                                          "top_p": top_p, "seed": 1})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"] == greedy.json()["choices"]
    assert byte_client.get("/health").status_code == 200


def test_null_fields_take_their_defaults_as_openai_does(byte_client):
    """OpenAI's optional fields are nullable: clients that send every field (null when unset) are answered as if
    those fields were left out."""
    nulls = dict.fromkeys(("top_p", "top_k", "n", "stop", "seed", "stream", "stream_options", "presence_penalty",
                           "frequency_penalty", "logit_bias", "user", "ignore_eos"))
    want = byte_client.post("/v1/completions", json=BYTE_OK)
    got = byte_client.post("/v1/completions", json={**BYTE_OK, **nulls, "echo": None, "logprobs": None,
                                                    "suffix": None, "best_of": None})
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"]
    want = byte_client.post("/v1/chat/completions", json=CHAT)
    got = byte_client.post("/v1/chat/completions", json={
        **CHAT, **nulls, "max_completion_tokens": None, "logprobs": None,
        "messages": [{"role": "user", "content": "hi", "name": None}]})
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"]
    stream = byte_client.post("/v1/completions", json={**BYTE_OK, "stream": True,
                                                        "stream_options": {"include_usage": None}})
    assert stream.status_code == 200 and '"usage"' not in stream.text and stream.text.endswith("data: [DONE]\n\n")


def test_a_model_is_retrieved_by_its_id(byte_client):
    """GET /v1/models/{id}, as the openai client's `models.retrieve` asks."""
    listed = byte_client.get("/v1/models").json()["data"][0]
    resp = byte_client.get("/v1/models/m")
    assert resp.status_code == 200 and resp.json() == listed
    resp = byte_client.get("/v1/models/gpt-4")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


def test_prompts_are_tokenized_off_the_event_loop(byte_client, monkeypatch):
    """Tokenizing (and templating) a long prompt takes a while: it must not stall the event loop, which serves
    every other client's stream meanwhile."""
    engine, on_loop = byte_client.engine, []

    def spy(name):
        method = getattr(engine, name)

        def call(*args):
            try:
                asyncio.get_running_loop()
                on_loop.append(name)
            except RuntimeError:  # no loop runs in this thread
                pass
            return method(*args)
        return call

    for name in ("encode", "encode_chat"):
        monkeypatch.setattr(engine, name, spy(name))
    assert byte_client.post("/v1/completions", json=BYTE_OK).status_code == 200
    assert byte_client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert on_loop == []


def test_sample_rows_samples_each_row_as_alone():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    configs = [SamplingConfig(), SamplingConfig(0.7, 5, 1.0, 3), SamplingConfig(), SamplingConfig(1.2, 0, 0.8, 4)]
    generators = [make_generator(c, "cpu") for c in configs]
    got = sample_rows(logits, configs, generators)
    for b, cfg in enumerate(configs):
        assert got[b] == sample(logits[b:b + 1], cfg, make_generator(cfg, "cpu"))[0]


def test_scheduler_config_is_validated():
    for bad in ({"max_batch": 0}, {"max_context": 0}, {"prefill_chunk": 0}, {"max_queue": -1}):
        with pytest.raises(SparseSpecError):
            SchedulerConfig(**bad)


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log_path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def log(self) -> str:
        return self.log_path.read_text()

    def post(self, path: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
        """Raw POST (any bytes) -> (status, JSON body)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200
        return {(s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def wait_metrics(self, ok, timeout: float = 30) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if ok(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def _server_process(request, tmp_path_factory):
    """The server process, started as the module's first test starts when any test of the module selected to run
    needs it: it loads the model while the tests before the first server test run (`server` waits for it)."""
    if not any("server" in item.fixturenames for item in request.session.items if item.module is request.module):
        yield None
        return
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sparsespec", "serve", "--model", MODEL, "--port", str(port),
                                 "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--max-context",
                                 str(MAX_CONTEXT), "--prefill-chunk", str(PREFILL_CHUNK), "--shutdown-timeout",
                                 "20"], stdout=log, stderr=log, env=env)
    yield Server(proc, port, log_path)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.fixture(scope="module")
def server(_server_process):
    srv, proc = _server_process, _server_process.proc
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"the server exited: {srv.log()}"
        try:
            if srv.get("/health")[0] == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, f"the server did not come up: {srv.log()}"
        time.sleep(0.25)
    return srv


def _prompts() -> list[str]:
    return [corpora.text("wiki", 4 + 11 * n, seed=n) for n in range(8)]  # twice the slots: half of them queue


def _alone(engine, ids: list[int], max_tokens: int, sampling: SamplingConfig | None = None, stop=()):
    """What `generate` makes of the prompt alone: (text, token count)."""
    gen = GenerationConfig(max_new_tokens=max_tokens, sampling=sampling or SamplingConfig(), stop_strings=tuple(stop))
    result = engine.generate([ids], gen)
    return result.texts[0], len(result.token_ids[0])


@pytest.mark.slow
def test_models_and_health(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert server.get("/health") == (200, '{"status":"ok"}')


@pytest.mark.slow
def test_completion_greedy_equals_generate_streamed_and_not(server, smollm2_engine):
    prompt = "The three most important inventions of the nineteenth century were"
    want, count = _alone(smollm2_engine, smollm2_engine.encode(prompt), 20)
    resp = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert resp.choices[0].text == want
    assert resp.usage.completion_tokens == count and resp.usage.prompt_tokens == len(smollm2_engine.encode(prompt))
    assert resp.choices[0].finish_reason == ("length" if count == 20 else "stop")
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # streamed in pieces
    assert chunks[-1].usage.completion_tokens == count
    # token ids as the prompt: the same answer
    ids = smollm2_engine.encode(prompt)
    assert server.client.completions.create(model=MODEL, prompt=ids, max_tokens=20,
                                            temperature=0).choices[0].text == want


@pytest.mark.slow
def test_chat_equals_cli_generate_streamed_and_not(server):
    question = "Name three colours of the rainbow."
    # the CLI process starts (imports, loads the model) and generates while the server answers the two requests
    cli = subprocess.Popen([sys.executable, "-m", "sparsespec", "generate", "--model", MODEL, "--chat", "--prompt",
                            question, "--max-new-tokens", "12", "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        messages = [{"role": "user", "content": question}]
        resp = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                            temperature=0, stream=True))
        stdout, stderr = cli.communicate(timeout=300)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, stderr
    want = json.loads(stdout)
    assert resp.choices[0].message.content == want["text"] and resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == len(want["token_ids"])
    assert resp.usage.prompt_tokens == want["prompt_tokens"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason == resp.choices[0].finish_reason


@pytest.mark.slow
def test_concurrent_requests_equal_each_prompt_alone(server, smollm2_engine):
    """8 concurrent streamed requests through 4 slots (they join and leave the batch as slots free up): greedy
    ones, a seeded sampled one and one with a stop string (met at its 7th of 10 tokens) each get exactly what
    `generate` gives the prompt alone."""
    eng, max_tokens = smollm2_engine, 10
    prompts = _prompts()
    sampled = SamplingConfig(temperature=0.8, top_p=0.9, top_k=40, seed=7)
    settings = [{"temperature": 0}] * len(prompts)
    settings[3] = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "extra_body": {"top_k": 40}}
    settings[5] = {"temperature": 0, "stop": [" of"]}
    wants = []
    for i, p in enumerate(prompts):
        sampling = sampled if i == 3 else SamplingConfig()
        wants.append(_alone(eng, eng.encode(p), max_tokens, sampling, stop=[" of"] if i == 5 else ()))

    async def one(client, prompt, kwargs):
        text, usage, reasons = "", None, []
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 stream_options={"include_usage": True}, **kwargs)
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reasons.append(chunk.choices[0].finish_reason)
            usage = chunk.usage or usage
        return text, usage.completion_tokens, reasons[-1]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, p, s) for p, s in zip(prompts, settings)))

    got = asyncio.run(run())
    assert [(text, n) for text, n, _ in got] == wants
    assert got[5][2] == "stop" and " of" not in got[5][0]
    m = server.metrics()
    assert m["sparsespec_running_rows"] == 0 and m["sparsespec_queue_length"] == 0


def _error(status: int, body: dict, want_status: int, param=None, code=None):
    assert status == want_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and error["code"] == code, error


OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.mark.slow
@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/completions", b'{"model": "smollm2-135m", "prompt": ', 400, None, "invalid_json"),
    ("/v1/completions", b"not json at all", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {**OK, "max_tokens": "5"}, 400, "max_tokens", None),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {**OK, "prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {**OK, "frobnicate": 1}, 400, "frobnicate", None),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {**OK, "n": 2}, 400, "n", None),
    ("/v1/completions", {**OK, "prompt": [1] * MAX_CONTEXT}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**OK, "prompt": [10**9]}, 400, "prompt", None),
    ("/v1/completions", {**OK, "max_tokens": MAX_CONTEXT}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {**OK, "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "messages.0.role", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 1100}]}, 400,
     "messages", "context_length_exceeded"),
])
@pytest.mark.slow
def test_bad_input_is_answered_and_the_server_keeps_serving(server, path, body, status, param, code):
    _error(*server.post(path, body), status, param, code)
    assert server.post("/v1/completions", OK)[0] == 200


@pytest.mark.slow
def test_the_client_sees_openai_errors(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                              max_tokens=MAX_CONTEXT)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    status, text = server.get("/no/such/route")
    assert status == 404 and json.loads(text)["error"]["type"] == "not_found_error"


def _long_request(server: Server, stream: bool) -> http.client.HTTPConnection:
    """A request that would decode for long (EOS ignored), left open; -> its connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 900, "ignore_eos": True, "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


@pytest.mark.slow
def test_full_queue_answers_429_at_once_and_disconnects_free_their_slots(server):
    before = server.metrics().get('sparsespec_requests_total{finish_reason=cancelled}', 0)
    # the first (streamed) request running before the others are sent: requests sent together may be admitted in
    # any order (each is tokenized off the event loop), and the one read below must be a running one
    conns = [_long_request(server, stream=True)]
    server.wait_metrics(lambda m: m["sparsespec_running_rows"] == 1)
    conns += [_long_request(server, stream=i % 2 == 0) for i in range(1, MAX_BATCH + MAX_QUEUE)]
    try:
        m = server.wait_metrics(lambda m: m["sparsespec_running_rows"] == MAX_BATCH
                                and m["sparsespec_queue_length"] == MAX_QUEUE)
        assert (m["sparsespec_running_rows"], m["sparsespec_queue_length"]) == (MAX_BATCH, MAX_QUEUE)
        start = time.monotonic()
        with pytest.raises(openai.RateLimitError) as e:
            server.client.completions.create(model=MODEL, prompt="one more", max_tokens=2)
        assert time.monotonic() - start < 5 and e.value.body["code"] == "queue_full"
        assert server.metrics()["sparsespec_rejected_requests_total"] >= 1
        first = conns[0].getresponse()  # a running streamed request is streaming
        assert first.status == 200 and first.readline().startswith(b"data: {")
    finally:
        for conn in conns:
            conn.close()
    m = server.wait_metrics(lambda m: m["sparsespec_running_rows"] == 0 and m["sparsespec_queue_length"] == 0)
    assert (m["sparsespec_running_rows"], m["sparsespec_queue_length"]) == (0, 0)
    assert m['sparsespec_requests_total{finish_reason=cancelled}'] - before == MAX_BATCH + MAX_QUEUE
    assert server.post("/v1/completions", OK)[0] == 200


@pytest.mark.slow
def test_metrics_are_prometheus_text(server):
    status, text = server.get("/metrics")
    assert status == 200
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"sparsespec_queue_length", "sparsespec_running_rows", "sparsespec_generation_tokens_per_second",
            "sparsespec_time_to_first_token_seconds", "sparsespec_generation_tokens", "sparsespec_requests",
            "sparsespec_prompt_tokens", "sparsespec_decode_step_seconds"} <= names
    m = server.metrics()
    assert m["sparsespec_time_to_first_token_seconds_count"] >= 1 and m["sparsespec_generation_tokens_total"] > 0
    assert m["sparsespec_max_batch"] == MAX_BATCH


@pytest.mark.slow
def test_sigterm_finishes_the_request_in_flight_and_exits_cleanly(server):
    """(Last: it stops the module's server.)"""
    chunks = []
    first = threading.Event()

    def stream():
        for chunk in server.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True}):
            chunks.append(chunk)
            first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    reader.join(60)
    # uvicorn re-raises the signal once it has shut down gracefully: the process ends as SIGTERM'd, no error
    assert server.proc.wait(60) == -signal.SIGTERM
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 40
    log = server.log()
    assert "Traceback" not in log and "Application shutdown complete" in log and "Finished server process" in log
