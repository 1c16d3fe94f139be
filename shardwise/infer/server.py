"""`shardwise serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the engine.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events in OpenAI's chunk format, ending `data: [DONE]`),
GET /health, GET /metrics (Prometheus text).

The engine steps in a thread other than the event loop's (`shardwise serve`: the main thread, which
built the model; uvicorn runs beside it); a request submits its sequences there and waits on an
asyncio queue that the engine thread fills through a `Mailbox` (one wake-up of the loop a step). A client that goes
away (mid-stream, or while waiting for a whole answer) has its sequences cancelled: their
slots are free at the engine's next step. A request that would push more than `max_queue`
sequences into the waiting line is answered 429 at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass

from fastapi import Request  # at module level: FastAPI resolves the routes' (string) annotations here

from shardwise.infer.chat import ChatTemplate
from shardwise.generation.engine import Engine, EngineStopped, Output, Sequence
from shardwise.infer.metrics import ServerMetrics
from shardwise.infer.protocol import (DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, OpenAIError)
from shardwise.infer.responses import ChatResponder, CompletionResponder, sse

ENGINE_FAILED = OpenAIError(500, "the engine failed while generating (see the server log); /health says 503 "
                                 "until the server is restarted", code="engine_failed", kind="server_error")


@dataclass
class Service:
    engine: Engine
    tokenizer: object
    model_name: str
    chat_template: ChatTemplate
    api_key: str | None = None
    max_queue: int = 256
    max_body_bytes: int = 1 << 20


def build_app(service: Service):
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI(title="shardwise", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(service.engine)
    engine = service.engine
    mailbox: Mailbox | None = None  # made by the first request, on the server's event loop

    def error_response(err: OpenAIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request, err: OpenAIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request, err: RequestValidationError):
        first = err.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            return error_response(OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}"))
        message = f"{where or 'body'}: {first.get('msg')}" + (f" (got {first['input']!r})" if "input" in first and where else "")
        return error_response(OpenAIError(400, message, param=where))

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Authorization, body size, and per-route counts and latency."""
        start = time.perf_counter()
        if service.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {service.api_key}":
                return error_response(OpenAIError(401, "invalid or missing API key: send 'Authorization: Bearer "
                                                       "<key>' with the key given to --api-key",
                                                  code="invalid_api_key", kind="authentication_error"))
        length = request.headers.get("content-length")
        if length is not None and int(length) > service.max_body_bytes:
            return error_response(OpenAIError(400, f"the request body has {length} bytes, more than the "
                                                   f"{service.max_body_bytes} this server accepts",
                                              code="request_too_large"))
        response = await call_next(request)
        metrics.observe_request(request.url.path, response.status_code, time.perf_counter() - start)
        return response

    @app.get("/health")
    async def health():
        alive = engine.serving
        body = {"status": "ok" if alive else "engine stopped", "running": engine.num_running(),
                "waiting": engine.num_waiting()}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "shardwise", "max_model_len": engine.context_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_request(body)
        prompts = completion_prompts(body.prompt, service.tokenizer)
        params = body.sampling(logprobs=body.logprobs, default_max_tokens=DEFAULT_MAX_TOKENS)
        job = submit(prompts, params, body.n)
        return await answer(job, CompletionResponder(service.model_name, service.tokenizer, body, prompts, job.id),
                            request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request(body)
        messages = [{**message.model_dump(exclude_none=True), "content": message.text()} for message in body.messages]
        text = service.chat_template.render(messages)
        prompt = service.tokenizer.encode(text).ids
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling(logprobs=logprobs, default_max_tokens=engine.context_len - len(prompt),
                               extra_stop=service.chat_template.default_stop)
        job = submit([prompt], params, body.n)
        return await answer(job, ChatResponder(service.model_name, service.tokenizer, body, [prompt], job.id),
                            request)

    async def answer(job: "Job", responder, request):
        """The whole answer as JSON, or (`stream: true`) server-sent events as the tokens come."""
        if responder.body.stream:
            return StreamingResponse(stream_events(job, responder), media_type="text/event-stream")
        outputs = await job.collect(request)
        return JSONResponse(responder.whole(outputs))  # a plain dict: skips FastAPI's jsonable_encoder walk

    def check_request(body) -> None:
        if body.model != service.model_name:
            raise OpenAIError(400, f"model {body.model!r} is not served here; use {service.model_name!r} "
                                   "(GET /v1/models lists it)", param="model", code="model_not_found")
        field = body.unsupported()
        if field:
            raise OpenAIError(400, f"{field} is not supported by this server; leave it out", param=field)

    def submit(prompts: list[list[int]], params, n: int) -> "Job":
        for prompt in prompts:
            try:
                engine.check_prompt(prompt, params)
            except ValueError as err:
                raise OpenAIError(400, str(err), param=param_of(str(err))) from None
        if engine.num_waiting() + len(prompts) * n > service.max_queue:
            metrics.rejected.inc()
            raise OpenAIError(429, f"the server's queue is full ({service.max_queue} waiting sequences); retry later",
                              code="queue_full", kind="rate_limit_error")
        nonlocal mailbox
        mailbox = mailbox or Mailbox(asyncio.get_running_loop())
        try:
            return Job(engine, prompts, params, n, metrics, mailbox)
        except EngineStopped as err:
            raise OpenAIError(503, str(err), code="engine_stopped", kind="server_error") from None

    return app


def param_of(message: str) -> str | None:
    """The request field an engine error is about (its message starts with the field's name)."""
    first = message.split(" ", 1)[0]
    return "prompt" if "prompt" in message.split(";")[0] else (first if first.isidentifier() else None)


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt).ids]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise OpenAIError(400, "prompt is empty: give text or token ids", param="prompt")
    return [tokenizer.encode(p).ids if isinstance(p, str) else list(p) for p in prompt]


class Mailbox:
    """Carries outputs from the engine thread to the event loop: one wake-up of the loop per engine
    step, not one per token (the loop and the engine share the interpreter and, here, the cores)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock = loop, threading.Lock()
        self.pending: list[tuple[asyncio.Queue, Output]] = []

    def post(self, queue: asyncio.Queue, output: Output) -> None:  # the engine thread
        with self.lock:
            self.pending.append((queue, output))
            wake = len(self.pending) == 1
        if wake:
            self.loop.call_soon_threadsafe(self.deliver)

    def deliver(self) -> None:  # the event loop
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, output in pending:
            queue.put_nowait(output)


class Job:
    """The sequences of one request (prompts x n choices) and the queue their outputs arrive on."""

    def __init__(self, engine: Engine, prompts, params, n: int, metrics: ServerMetrics, mailbox: Mailbox):
        self.id = uuid.uuid4().hex[:24]
        self.engine, self.metrics = engine, metrics
        self.queue: asyncio.Queue[Output | None] = asyncio.Queue()
        self.sequences: list[Sequence] = []
        for prompt in prompts:
            for choice in range(n):
                self.sequences.append(engine.submit(prompt, params, lambda out: mailbox.post(self.queue, out),
                                                    choice=choice))
        self.index = {seq: i for i, seq in enumerate(self.sequences)}
        self.open = len(self.sequences)
        metrics.prompt_tokens.inc(sum(len(p) for p in prompts) * n)

    async def outputs(self):
        """Outputs as they come, until every sequence has finished (or `None` says the client left);
        whatever is unfinished then is cancelled, also when the consumer is cancelled."""
        try:
            while self.open:
                output = await self.queue.get()
                if output is None:
                    return
                if output.token is not None:
                    self.metrics.generated_tokens.inc()
                if output.finish_reason is not None:
                    self.open -= 1
                    seq = output.sequence
                    if seq.first_token_at:
                        self.metrics.first_token.observe(seq.first_token_at - seq.submitted_at)
                yield output
        finally:
            for seq in self.sequences:
                if seq.finish_reason is None:
                    self.engine.cancel(seq)

    async def watch_disconnect(self, request) -> None:
        """The body has been read: the next ASGI message is the client's disconnect."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.queue.put_nowait(None)

    async def collect(self, request) -> list[list[Output]]:
        per_sequence: list[list[Output]] = [[] for _ in self.sequences]
        watcher = asyncio.create_task(self.watch_disconnect(request))
        try:
            async for output in self.outputs():
                per_sequence[self.index[output.sequence]].append(output)
        finally:
            watcher.cancel()
        if self.open:
            raise OpenAIError(499, "client closed the request")
        if any(outputs[-1].finish_reason == "error" for outputs in per_sequence):
            raise ENGINE_FAILED
        return per_sequence


async def stream_events(job: Job, responder):
    for chunk in responder.first_chunks():
        yield sse(chunk)
    async for output in job.outputs():  # a client that leaves cancels this generator: its sequences end
        if output.finish_reason == "error":
            yield sse(ENGINE_FAILED.body())
            return
        chunk = responder.chunk(job.index[output.sequence], output)
        if chunk is not None:
            yield sse(chunk)
    if job.open:
        return
    usage = responder.usage_chunk(job.sequences)
    if usage is not None:
        yield sse(usage)
    yield "data: [DONE]\n\n"
