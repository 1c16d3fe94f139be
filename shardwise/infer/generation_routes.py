"""`shardwise serve`'s generating routes: POST /v1/completions and POST /v1/chat/completions, both
with `stream: true` as server-sent events in OpenAI's chunk format, ending `data: [DONE]`."""

from __future__ import annotations

from fastapi import Request  # at module level: FastAPI resolves the routes' (string) annotations here

from shardwise.infer.jobs import Admission, answer
from shardwise.infer.protocol import (DEFAULT_MAX_TOKENS, ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest,
                                     OpenAIError)
from shardwise.infer.responses import ChatResponder, CompletionResponder
from shardwise.infer.service import Service


def add_generation_routes(app, service: Service, admission: Admission) -> None:
    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        check_request(body, service)
        prompts = completion_prompts(body.prompt, service.tokenizer)
        params = body.sampling(logprobs=body.logprobs, default_max_tokens=DEFAULT_MAX_TOKENS)
        job = admission.submit(prompts, params, body.n, length_param=body.max_tokens_param())
        return await answer(job, CompletionResponder(service.model_name, service.tokenizer, body, prompts, job.id),
                            request)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_request(body, service)
        body.check_logprobs()
        prompt = service.chat_tokenizer.encode(chat_prompt(body, service)).ids
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling(logprobs=logprobs, default_max_tokens=max(service.engine.context_len - len(prompt), 1),
                               extra_stop=service.chat_template.default_stop)
        job = admission.submit([prompt], params, body.n, prompt_param="messages", length_param=body.max_tokens_param())
        return await answer(job, ChatResponder(service.model_name, service.tokenizer, body, [prompt], job.id),
                            request)


def check_request(body, service: Service) -> None:
    if body.model != service.model_name:
        raise OpenAIError(400, f"model {body.model!r} is not served here; use {service.model_name!r} "
                               "(GET /v1/models lists it)", param="model", code="model_not_found")
    field = body.unsupported()
    if field:
        raise OpenAIError(400, f"{field} is not supported by this server; leave it out", param=field)


def chat_prompt(body, service: Service) -> str:
    """The messages as the run's chat template renders them; a template that refuses them (its
    raise_exception, e.g. roles that do not alternate) or fails on them is the request's 400."""
    import jinja2

    messages = [{**message.model_dump(exclude_none=True), "content": message.text()} for message in body.messages]
    try:
        return service.chat_template.render(messages)
    except (ValueError, TypeError, jinja2.TemplateError) as err:
        raise OpenAIError(400, f"messages: the chat template could not render them ({err})", param="messages") from None


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt).ids]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise OpenAIError(400, "prompt is empty: give text or token ids", param="prompt")
    return [tokenizer.encode(p).ids if isinstance(p, str) else list(p) for p in prompt]
