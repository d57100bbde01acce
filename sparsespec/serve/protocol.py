"""The OpenAI protocol subset `sparsespec serve` speaks: request models (pydantic, strict types, unknown fields
refused, null as the default), their translation into a validated `GenerationConfig`, the response and stream-chunk
objects, and the error object `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import SparseSpecError
from ..generate import GenerationConfig
from ..sampling import SamplingConfig

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's legacy completions endpoint
# a stop string: not empty (GenerationConfig refuses it too), and of a length a request may sensibly hold
StopString = Annotated[str, Field(min_length=1, max_length=1024)]


class APIError(Exception):
    """An error answered as the OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An optional field sent as null takes its default (OpenAI's optional fields are nullable: some clients
        send every field); a required one stays null, and is refused."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}
        return data


def _unicode(text: str) -> str:
    """`text`, refused when it is not Unicode (JSON can spell a lone surrogate; a tokenizer cannot take it)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("the text is not valid Unicode (a lone surrogate)") from None
    return text


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """The sampling and stop fields both endpoints share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="0 or -1: off (vLLM's extension)")
    seed: int | None = Field(None, ge=-2**63, lt=2**64)  # what torch.Generator takes (as SamplingConfig checks)
    stop: StopString | Annotated[list[StopString], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = Field(False, description="generate max_tokens tokens regardless of EOS (vLLM's extension)")
    user: str | None = None
    # accepted at their neutral values only: anything else is refused rather than silently ignored
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def generation(self, prompt_tokens: int, max_context: int, default_max_tokens: int | None,
                   prompt_param: str) -> GenerationConfig:
        """-> the request's GenerationConfig; APIError 400 when the prompt and max_tokens do not fit a slot.
        `default_max_tokens` None: the rest of the context."""
        if self.stream_options is not None and not self.stream:  # (as OpenAI)
            raise APIError(400, "stream_options are only allowed when stream is true", param="stream_options")
        if prompt_tokens == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        room = max_context - prompt_tokens
        if room < 1:
            raise APIError(400, f"this server's maximum context length is {max_context} tokens; the prompt has "
                           f"{prompt_tokens} tokens, which leaves no room for a completion", param=prompt_param,
                           code="context_length_exceeded")
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"this server's maximum context length is {max_context} tokens; you requested "
                           f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for "
                           "the completion)", param="max_tokens", code="context_length_exceeded")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            sampling = SamplingConfig(self.temperature, max(self.top_k, 0), self.top_p, self.seed)
            return GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, stop_strings=stop,
                                    stop_on_eos=not self.ignore_eos)
        except SparseSpecError as e:
            raise APIError(400, str(e)) from None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[Annotated[int, Field(ge=0)]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and any(isinstance(x, (str, list)) for x in v):
            raise ValueError("a list of prompts is not supported (send one prompt per request)")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, v: str | list[int]) -> str | list[int]:
        return _unicode(v) if isinstance(v, str) else v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("only best_of = 1 is supported")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, v: str) -> str:
        return _unicode(v)


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, v: str | list[TextPart]) -> str | list[TextPart]:
        return _unicode(v) if isinstance(v, str) else v

    def as_template(self) -> dict[str, str]:
        """The message as chat templates take it ("developer" is the newer name of "system")."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseFormat:
    """The objects one request's answer is made of (the completions endpoint's; `ChatFormat`: the chat one's)."""

    object = "text_completion"
    chunk_object = "text_completion"
    prefix = "cmpl"

    def __init__(self, model: str):
        self.model = model
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
        return self.choice(text, finish_reason)

    def response(self, text: str, finish_reason: str, use: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.object, [self.choice(text, finish_reason)]), "usage": use}

    def chunk(self, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [self.delta(text, finish_reason, first)])

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": use}


class ChatFormat(ResponseFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl"

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def delta(self, text: str, finish_reason: str | None, first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
