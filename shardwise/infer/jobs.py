"""A request's sequences in the engine, seen from the server's event loop.

`Admission` checks a request's prompts against the engine and the waiting line (429 when it is
full) and submits them as a `Job`; the job's outputs arrive on an asyncio queue that the engine
thread fills through a `Mailbox` (one wake-up of the loop a step); `answer` returns them whole or
streams them. A client that goes away (mid-stream, or while waiting for a whole answer) has its
sequences cancelled: their slots are free at the engine's next step.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

from fastapi.responses import JSONResponse, StreamingResponse

from shardwise.generation.engine import Engine, EngineStopped
from shardwise.generation.sampling import InvalidRequest
from shardwise.generation.sequence import Output, Sequence
from shardwise.infer.metrics import ServerMetrics
from shardwise.infer.protocol import OpenAIError
from shardwise.infer.responses import sse

def engine_failed(error_id: str | None) -> OpenAIError:
    """The answer of a request whose sequences ended in an engine failure (`Engine.fail_step`)."""
    return OpenAIError(500, f"the engine failed while generating this request (error id {error_id}; the server "
                            "log has its traceback under that id); the server goes on serving, retry the request",
                       code="engine_failed", kind="server_error")


class Admission:
    """Submits requests to the engine, from the server's event loop."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, *, max_queue: int):
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.mailbox: Mailbox | None = None  # made by the first request, on the server's event loop

    def submit(self, prompts: list[list[int]], params, n: int, *, prompt_param: str = "prompt",
               length_param: str | None = None) -> Job:
        """`length_param`: the request's own name of max_tokens where it gave one (then the prompt and
        max_tokens must fit the context, as OpenAI answers; a default max_tokens is cut at the
        context instead, with finish_reason "length")."""
        for prompt in prompts:
            try:
                self.engine.check_prompt(prompt, params)
            except InvalidRequest as err:
                param = {"prompt": prompt_param, "max_tokens": length_param}.get(err.param) or err.param
                raise OpenAIError(400, str(err), param=param) from None
            if length_param and len(prompt) + params.max_tokens > self.engine.context_len:
                raise OpenAIError(400, f"{length_param} = {params.max_tokens} is invalid: the model's context is "
                                       f"{self.engine.context_len} tokens and the prompt has {len(prompt)}; ask for at "
                                       f"most {self.engine.context_len - len(prompt)} (or shorten the prompt)",
                                  param=length_param)
        if len(prompts) * n > self.max_queue:
            raise OpenAIError(400, f"n = {n} is invalid: the request asks for {len(prompts) * n} sequences (prompts x n), "
                                   f"more than this server's queue of {self.max_queue}; send fewer prompts or a smaller n",
                              param="n")
        if self.engine.num_waiting() + len(prompts) * n > self.max_queue:
            self.metrics.rejected.inc()
            raise OpenAIError(429, f"the server's queue is full ({self.max_queue} waiting sequences); retry later",
                              code="queue_full", kind="rate_limit_error")
        loop = asyncio.get_running_loop()
        if self.mailbox is None or self.mailbox.loop is not loop:  # one loop serves; tests' clients may start others
            self.mailbox = Mailbox(loop)
        try:
            return Job(self.engine, prompts, params, n, self.metrics, self.mailbox)
        except EngineStopped as err:
            raise OpenAIError(503, str(err), code="engine_stopped", kind="server_error") from None


async def answer(job: Job, responder, request):
    """The whole answer as JSON, or (`stream: true`) server-sent events as the tokens come."""
    if responder.body.stream:
        return StreamingResponse(stream_events(job, responder), media_type="text/event-stream")
    outputs = await job.collect(request)
    return JSONResponse(responder.whole(outputs))  # a plain dict: skips FastAPI's jsonable_encoder walk


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
        failed = next((outputs[-1] for outputs in per_sequence if outputs[-1].finish_reason == "error"), None)
        if failed is not None:
            raise engine_failed(failed.sequence.error_id)
        return per_sequence


async def stream_events(job: Job, responder):
    for chunk in responder.first_chunks():
        yield sse(chunk)
    async for output in job.outputs():  # a client that leaves cancels this generator: its sequences end
        if output.finish_reason == "error":
            yield sse(engine_failed(output.sequence.error_id).body())
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
