"""OpenAI's request bodies (pydantic) and error JSON, as `shardwise serve` accepts and answers them.

Fields OpenAI defines and this server does not implement (best_of > 1, suffix, tools, response
formats other than text) are refused with a 400 naming them, not ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shardwise.generation.sampling import MAX_TOP_LOGPROBS, SamplingParams

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class OpenAIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error JSON, for the OpenAPI schema (clients and schemathesis read the answers from it)."""

    error: ErrorDetail


ERROR_RESPONSES = {
    400: {"model": ErrorBody, "description": "invalid request: the error's param names the field"},
    401: {"model": ErrorBody, "description": "missing or wrong API key"},
    429: {"model": ErrorBody, "description": "the queue is full; retry later"},
    499: {"model": ErrorBody, "description": "the client closed the request"},
    500: {"model": ErrorBody, "description": "the engine failed on this request; the error id is in the server log"},
    503: {"model": ErrorBody, "description": "the engine has stopped; restart the server"},
}
"""The error answers of the generating routes, as their OpenAPI schema lists them."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share. Strict, as OpenAI's API is: `max_tokens:
    true` or `"5"` is a 400 naming the field, not a count of 1 or 5."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # not OpenAI's; vLLM and others accept it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_param(self) -> str | None:
        """The request's name of its max_tokens, where it gave one."""
        return None if self.max_tokens is None else "max_tokens"

    def sampling(self, *, logprobs: int | None, default_max_tokens: int, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            bias = {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise OpenAIError(400, f"logit_bias keys must be token ids, got {list(self.logit_bias)}",
                              param="logit_bias") from None
        max_tokens = default_max_tokens if self.requested_max_tokens() is None else self.requested_max_tokens()
        params = SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            stop=stop + tuple(s for s in extra_stop if s not in stop), stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos, seed=self.seed, logprobs=logprobs, logit_bias=bias,
        )
        return params


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> str | None:
        if self.best_of not in (None, 1) and self.best_of != self.n:
            return "best_of"
        if self.suffix:
            return "suffix"
        return None


class ContentPart(BaseModel):
    """A part of a message's content: only {"type": "text", "text": ...} is understood."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            kinds = sorted({part.type for part in self.content} - {"text"})
            if kinds:
                raise OpenAIError(400, f"messages: content parts of type {kinds} are not supported; send text parts",
                                  param="messages")
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def requested_max_tokens(self) -> int | None:  # the newer name first, as OpenAI reads them
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def max_tokens_param(self) -> str | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().max_tokens_param()

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format"
        return None

    def check_logprobs(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, f"top_logprobs = {self.top_logprobs} is invalid without logprobs: set logprobs "
                                   "to true as well", param="top_logprobs")
