"""OpenAI's response shapes for `shardwise serve`: whole answers and streamed chunks of
/v1/completions (`text_completion`) and /v1/chat/completions (`chat.completion[.chunk]`), with
usage and logprobs in each endpoint's own format."""

from __future__ import annotations

import json
import time

from shardwise.generation.engine import Output, Sequence


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Responder:
    object_name = ""

    def __init__(self, model_name: str, tokenizer, body, prompts: list[list[int]], job_id: str):
        self.model_name, self.tokenizer, self.body, self.prompts = model_name, tokenizer, body, prompts
        self.id = f"{self.id_prefix}-{job_id}"
        self.created = int(time.time())

    def envelope(self, choices: list[dict], *, chunk: bool) -> dict:
        name = self.object_name + (".chunk" if chunk and self.object_name == "chat.completion" else "")
        return {"id": self.id, "object": name, "created": self.created, "model": self.model_name,
                "choices": choices}

    def usage(self, sequences: list[Sequence]) -> dict:
        """As OpenAI counts: each prompt once (its n choices share it), with `cached_tokens` those of its
        tokens the prefix cache supplied to its first choice."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(s.output_ids) for s in sequences)
        per_prompt = len(sequences) // max(len(self.prompts), 1)  # sequences are prompt-major (jobs.Job)
        cached = sum(s.num_reused for s in sequences[::per_prompt]) if per_prompt else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def usage_chunk(self, sequences) -> dict | None:
        options = self.body.stream_options
        if options is None or not options.include_usage:
            return None
        return {**self.envelope([], chunk=True), "usage": self.usage(sequences)}

    def first_chunks(self) -> list[dict]:
        return []

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class CompletionResponder(Responder):
    object_name, id_prefix = "text_completion", "cmpl"

    def logprobs(self, outputs: list[Output], offset: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        tokens, token_logprobs, top, offsets = [], [], [], []
        for output in outputs:
            if output.token is None:
                continue
            text = self.token_text(output.token.token_id)
            tokens.append(text)
            token_logprobs.append(output.token.logprob)
            top.append({self.token_text(t): lp for t, lp in (output.token.top or [])} if self.body.logprobs else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def whole(self, per_sequence: list[list[Output]]) -> dict:
        choices = []
        for index, outputs in enumerate(per_sequence):
            prompt_text = self.echo_text(index)
            text = prompt_text + "".join(o.text for o in outputs)
            choices.append({"index": index, "text": text, "logprobs": self.logprobs(outputs, len(prompt_text)),
                            "finish_reason": finish_reason(outputs[-1].finish_reason)})
        sequences = [outputs[-1].sequence for outputs in per_sequence]
        return {**self.envelope(choices, chunk=False), "usage": self.usage(sequences)}

    def echo_text(self, index: int) -> str:
        if not self.body.echo:
            return ""
        return self.tokenizer.decode(self.prompts[index // self.body.n])

    def first_chunks(self) -> list[dict]:
        if not self.body.echo:
            return []
        return [self.envelope([{"index": i, "text": self.echo_text(i), "logprobs": None, "finish_reason": None}],
                              chunk=True) for i in range(len(self.prompts) * self.body.n)]

    def chunk(self, index: int, output: Output) -> dict | None:
        if not output.text and output.finish_reason is None and self.body.logprobs is None:
            return None
        choice = {"index": index, "text": output.text, "logprobs": self.logprobs([output], 0),
                  "finish_reason": finish_reason(output.finish_reason)}
        return self.envelope([choice], chunk=True)


class ChatResponder(Responder):
    object_name, id_prefix = "chat.completion", "chatcmpl"

    def logprobs(self, outputs: list[Output]) -> dict | None:
        if not self.body.logprobs:
            return None
        content = []
        for output in outputs:
            if output.token is None:
                continue
            content.append({**self.token_entry(output.token.token_id, output.token.logprob),
                            "top_logprobs": [self.token_entry(t, lp) for t, lp in (output.token.top or [])]})
        return {"content": content}

    def token_entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def whole(self, per_sequence: list[list[Output]]) -> dict:
        choices = []
        for index, outputs in enumerate(per_sequence):
            message = {"role": "assistant", "content": "".join(o.text for o in outputs)}
            choices.append({"index": index, "message": message, "logprobs": self.logprobs(outputs),
                            "finish_reason": finish_reason(outputs[-1].finish_reason)})
        sequences = [outputs[-1].sequence for outputs in per_sequence]
        return {**self.envelope(choices, chunk=False), "usage": self.usage(sequences)}

    def first_chunks(self) -> list[dict]:
        return [self.envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}], chunk=True) for i in range(self.body.n)]

    def chunk(self, index: int, output: Output) -> dict | None:
        if not output.text and output.finish_reason is None and not self.body.logprobs:
            return None
        delta = {"content": output.text} if output.text or output.finish_reason is None else {}
        choice = {"index": index, "delta": delta, "logprobs": self.logprobs([output]),
                  "finish_reason": finish_reason(output.finish_reason)}
        return self.envelope([choice], chunk=True)


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "cancelled" else reason)
