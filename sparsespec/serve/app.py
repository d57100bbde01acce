"""The HTTP layer: a FastAPI app over one `Scheduler`.

    GET  /health                 200 while the scheduler runs, else 503
    GET  /metrics                Prometheus text
    GET  /v1/models              the one served model
    GET  /v1/models/{id}         it, by its id (404 for any other)
    POST /v1/completions         prompt (text or token ids) -> text
    POST /v1/chat/completions    messages -> the model's chat template -> the assistant's text

A request body over `ServeConfig.max_request_bytes` is answered 413 before anything reads it (`BodyLimit`). Each
generation request is validated (400 with the OpenAI error object, the parameter named), encoded, and queued
(429 at once when the queue is full); its events come back from the scheduler thread through an asyncio queue and
are answered as one JSON object or streamed as server-sent events ending with `data: [DONE]`. A client that goes
away (detected while waiting, not only when a write fails) cancels its request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from ..attention.policy import Policy
from ..spec.drafters import Drafter
from ..errors import SparseSpecError
from ..generate import Engine, GenerationConfig
from .protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, APIError, ChatFormat, ChatRequest, CompletionRequest,
                       ResponseFormat, usage)
from .scheduler import Event, Job, NotRunning, QueueFull, Scheduler, SchedulerConfig

log = logging.getLogger("sparsespec.serve")


@dataclass(frozen=True)
class ServeConfig:
    model_name: str  # the id clients pass as `model`
    scheduler: SchedulerConfig
    stop_timeout: float = 30.0  # shutdown: seconds to wait for the scheduler's current step
    max_request_bytes: int = 16 * 2**20  # a longer request body is refused (413) before it is read

    def __post_init__(self):
        if not self.model_name:
            raise SparseSpecError("the served model name is empty")
        if self.max_request_bytes < 1:
            raise SparseSpecError(f"the request size limit must be at least 1 byte, got {self.max_request_bytes}")


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 (the OpenAI error object, code
    request_too_large) before the app reads it, so that no client can make the server hold an unbounded body in
    memory: at once by its Content-Length (the HTTP server then delivers no more than that), else (chunked, even
    beside a Content-Length) counted as it arrives, the body held here up to the limit and handed on whole."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and b"transfer-encoding" not in headers:  # (with both, the chunks decide the length)
            if length.isdigit() and int(length) > self.limit:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body: nobody to answer
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():  # the body once, then what the client sends next (its disconnect)
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        error = APIError(413, f"the request body is over this server's limit of {self.limit} bytes "
                         f"(serve --max-request-bytes)", code="request_too_large")
        await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)


class Server:
    """The app's state: the engine, its scheduler and the served name."""

    def __init__(self, engine: Engine, config: ServeConfig, policy: Policy | None = None,
                 drafter: Drafter | None = None):
        self.engine, self.config = engine, config
        self.scheduler = Scheduler(engine, config.scheduler, policy, drafter)
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(404, f"the model {name!r} does not exist (this server serves "
                           f"{self.config.model_name!r})", param="model", code="model_not_found")

    def generation(self, body: CompletionRequest | ChatRequest, ids: list[int], prompt_param: str,
                   default_max_tokens: int | None) -> GenerationConfig:
        return body.generation(len(ids), self.config.scheduler.max_context, default_max_tokens, prompt_param)

    async def answer(self, request: Request, ids: list[int], gen: GenerationConfig, fmt: ResponseFormat,
                     stream: bool, include_usage: bool) -> Response:
        events = self._submit(ids, gen)
        if stream:
            return StreamingResponse(self._sse(request, events, fmt, len(ids), include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text, last = [], None
        async for event in _until_disconnected(request, *events):
            text.append(event.text)
            last = event
        if last is None:  # the client left: nobody reads this
            return Response(status_code=499)
        _raise_failure(last)
        return JSONResponse(fmt.response("".join(text), last.finish_reason, usage(len(ids), last.completion_tokens)))

    def _submit(self, ids: list[int], gen: GenerationConfig) -> tuple[Job, asyncio.Queue[Event]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(event: Event) -> None:  # the scheduler thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop has closed (shutdown): nobody is waiting
                pass

        job = Job(ids, gen, deliver)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except NotRunning as e:
            raise APIError(503, str(e), type="server_error", code="unavailable") from None
        return job, queue

    async def _sse(self, request: Request, events: tuple[Job, asyncio.Queue[Event]], fmt: ResponseFormat,
                   prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        first = True
        async for event in _until_disconnected(request, *events):
            if event.finish_reason in ("error", "cancelled"):
                yield _data(_failure(event).body())
                return
            if event.text or event.finish_reason:
                yield _data(fmt.chunk(event.text, event.finish_reason, first))
                first = False
            if event.finish_reason:
                if include_usage:
                    yield _data(fmt.usage_chunk(usage(prompt_tokens, event.completion_tokens)))
                yield "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _failure(event: Event) -> APIError:
    if event.finish_reason == "error":
        return APIError(500, event.error or "generation failed", type="server_error")
    return APIError(503, "the server is shutting down: the request was cancelled", type="server_error",
                    code="unavailable")


def _raise_failure(event: Event) -> None:
    if event.finish_reason in ("error", "cancelled"):
        raise _failure(event)


async def _until_disconnected(request: Request, job: Job,
                              queue: asyncio.Queue[Event]) -> AsyncIterator[Event]:
    """The job's events up to its last one, or until the client disconnects (then no more). However it ends
    (finished, client gone, response task cancelled), the job is cancelled, freeing its slot if it still holds
    one."""
    disconnected = asyncio.ensure_future(_disconnect(request))
    try:
        while True:
            if queue.empty():  # wait for the next event or the client leaving (a task only when waiting)
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait((get, disconnected), return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    return
                event = get.result()
            elif disconnected.done():
                return
            else:
                event = queue.get_nowait()
            yield event
            if event.finish_reason is not None:
                return
    finally:
        disconnected.cancel()
        job.cancel()


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
BODY_NOT_PARSED = "There was an error parsing the body"  # FastAPI's detail for a body its JSON reading failed on


def _param(loc: tuple) -> str | None:
    """A validation error's location -> the parameter's path ("messages.0.role"), without pydantic's "body" root
    and union member tags ("str", "list[int]", "function-after[...]")."""
    parts = [str(x) for x in loc if isinstance(x, int) or (x != "body" and x not in _TYPE_TAGS
                                                            and "[" not in x and "-" not in x)]
    return ".".join(parts) or None


def _body_error(error: dict) -> str:
    """The message of a validation error of the request body as a whole."""
    if error.get("type") == "missing":
        return "the request body is empty: send a JSON object"
    if isinstance(error.get("input"), bytes):  # not parsed: its Content-Type is not JSON
        return "the request body must be JSON sent with Content-Type: application/json"
    return "the request body must be a JSON object"


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: Engine, config: ServeConfig, policy: Policy | None = None,
               drafter: Drafter | None = None) -> FastAPI:
    """`policy`: the sparse decode attention of every request (a graphable policy), None for dense. `drafter`:
    lossless speculative decoding of every request."""
    server = Server(engine, config, policy, drafter)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.scheduler.start()
        yield
        await asyncio.to_thread(server.scheduler.stop, config.stop_timeout)

    app = FastAPI(title="sparsespec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(BodyLimit, limit=config.max_request_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        if errors[0].get("type") == "json_invalid":
            reason = errors[0].get("ctx", {}).get("error")
            error = APIError(400, "the request body is not valid JSON" + (f": {reason}" if reason else ""),
                             code="invalid_json")
        elif _param(errors[0].get("loc", ())) is None:  # the body itself
            error = APIError(400, _body_error(errors[0]))
        else:
            param = _param(errors[0].get("loc", ()))
            # a union field fails once per member: a member that got inside the value (a list of token ids, of
            # content parts) or whose type the value has (a stop string too long) is the one meant; else say what
            # each member expected
            inner = [p for x in errors if (p := _param(x.get("loc", ()))) and p.startswith(param + ".")]
            param = inner[0] if inner else param
            here = [x for x in errors if _param(x.get("loc", ())) == param]
            here = [x for x in here if not x.get("type", "").endswith("_type")] or here
            reasons = dict.fromkeys(x.get("msg", "invalid").removeprefix("Value error, ") for x in here)
            message = " or ".join(reasons)
            error = APIError(400, f"{param}: {message}" if param else message, param=param)
        return JSONResponse(error.body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 400 and e.detail == BODY_NOT_PARSED:  # not UTF-8, or JSON nested past the parser's depth
            error = APIError(400, "the request body is not valid JSON: not UTF-8 text, or nested too deep",
                             code="invalid_json")
            return JSONResponse(error.body(), status_code=400)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), type=kind).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def crashed(_: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if server.scheduler.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(APIError(503, "the scheduler is not running", type="server_error").body(),
                            status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = server.scheduler.metrics.render()
        return Response(body, media_type=content_type)

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": server.created, "owned_by": "sparsespec",
                "max_model_len": config.scheduler.max_context}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        server.check_model(model)
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        # (tokenizing a long prompt takes a while: off the event loop, which serves the other clients meanwhile)
        ids = await asyncio.to_thread(engine.encode, body.prompt) if isinstance(body.prompt, str) else body.prompt
        if any(t >= engine.config.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be below the vocabulary size {engine.config.vocab_size}",
                           param="prompt")
        gen = server.generation(body, ids, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await server.answer(request, ids, gen, ResponseFormat(config.model_name), body.stream,
                                   body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        server.check_model(body.model)
        try:
            ids = await asyncio.to_thread(engine.encode_chat, [m.as_template() for m in body.messages])
        except (SparseSpecError, TemplateError) as e:  # no template, or the template refuses these messages
            raise APIError(400, str(e), param="messages") from None
        gen = server.generation(body, ids, "messages", None)
        return await server.answer(request, ids, gen, ChatFormat(config.model_name), body.stream, body.include_usage)

    return app
