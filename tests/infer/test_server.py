"""`shardwise serve` driven by the real `openai` client against a live server on localhost.

The server runs in this process (uvicorn in a thread, the engine in its own) over a run trained
here for a few steps; one test starts the real command in a subprocess.
"""

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import torch

from shardwise.config.loader import load_config
from shardwise.infer.chat import load_chat_template
from shardwise.infer.commands import generate_results
from shardwise.infer.load import open_engine
from shardwise.infer.server import Service, build_app
from shardwise.train.trainer import train
from serving_run import train_serving_run

MODEL = "tiny"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache):
    return train_serving_run(tmp_path_factory.mktemp("serve") / "run", data_cache, steps=300, **{"run.name": MODEL})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(run_dir, **service_options):
    import uvicorn

    engine_options = {key: service_options.pop(key) for key in ENGINE_OPTIONS if key in service_options}
    _, engine, tokenizer = open_engine(run_dir, device_name="cpu", **engine_options)
    service = Service(engine, tokenizer, MODEL, load_chat_template(run_dir), **service_options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(service), host="127.0.0.1", port=port, log_level="warning"))
    engine.start()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", service
    finally:
        server.should_exit = True
        thread.join()
        engine.stop()


ENGINE_OPTIONS = ("max_batch", "prefill_chunk", "prefix_cache_mb", "quantize", "speculate")
FEATURES = {
    "default": {},  # prefix caching on, as `serve` runs by default
    "no-prefix-cache": {"prefix_cache_mb": 0},
    "int8": {"quantize": "int8"},
    "ngram": {"speculate": "ngram"},  # up to its measured cutoff of running sequences, plain beyond it
}
"""Each feature of the engine, a flag of `serve`, runs every test of the live server below (issue 40)."""


@pytest.fixture(scope="module", params=list(FEATURES))
def server(run_dir, request):
    with live_server(run_dir, max_batch=8, prefill_chunk=32, **FEATURES[request.param]) as (url, service):
        service.feature = request.param
        yield url, service


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


PROMPT = "def main():\n    "


def test_models_lists_the_run(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completion_equals_generate_and_transformers(client, server, run_dir, tmp_path):
    """The same text as `shardwise generate` with the same feature; and, where the feature keeps the
    weights (all but quantization), as transformers' `generate` on the exported weights."""
    import transformers

    from shardwise.cli.main import build_parser
    from shardwise.convert import export_run_to_hf
    from shardwise.data.tokenizer import load_tokenizer

    served = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in FEATURES[server[1].feature].items()]
    args = build_parser().parse_args(["generate", "--run", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "24",
                                      "--temperature", "0", "--device", "cpu", *flags])
    assert served.choices[0].text == generate_results(args)[0]["completion"]
    if "quantize" in FEATURES[server[1].feature]:
        return

    export_run_to_hf(run_dir, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    prompt_ids = tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    hf_ids = out[0, len(prompt_ids):].tolist()
    assert served.usage.completion_tokens == len(hf_ids) == 24
    assert served.choices[0].text == tokenizer.decode(hf_ids)
    assert served.choices[0].finish_reason == "length"
    # Not a constant. A stronger check (more than 3 distinct tokens) held on earlier VMs but not on
    # one whose CPU rounds differently: its greedy continuation was [288, 28 x 23]; the 24-token
    # equality with transformers above is the test, this only rules out a constant output.
    assert len(set(hf_ids)) >= 2


def test_streaming_chunks_add_up_to_the_whole_answer(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0).choices[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20
    assert sum(bool(c.choices and c.choices[0].text) for c in chunks) > 3  # streamed, not all at the end


def test_stream_ends_with_done_as_server_sent_events(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_chat_uses_the_plain_template_and_streams(client, server, run_dir):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    rendered = "<|system|>\nbe brief\n<|user|>\ndef f\n<|assistant|>\n"
    plain = client.completions.create(model=MODEL, prompt=rendered, max_tokens=12, temperature=0, stop=["\n<|"])
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == plain.choices[0].text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[0].object == "chat.completion.chunk"


def test_chat_renders_the_runs_own_template(run_dir, tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>"}))
    rendered = load_chat_template(tmp_path).render([{"role": "user", "content": "hi"}])
    assert rendered == "<s>[USER] hi\n[ASSISTANT] "
    plain = load_chat_template(run_dir)
    assert plain.plain and plain.render([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"


def test_stop_strings_cut_the_output(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 2]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop, "@@@"])
    assert cut.choices[0].text == whole[:whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_seed_reproduces_whatever_runs_beside_it(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95,
                                         seed=seed).choices[0].text

    alone = sample(11)
    with ThreadPoolExecutor(6) as pool:
        crowd = list(pool.map(sample, [11, 12, 11, 13, 11, 14]))
    assert crowd[0] == crowd[2] == crowd[4] == alone
    assert len(set(crowd)) > 1


def test_n_choices_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, seed=5,
                                    logprobs=2)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert "".join(lp.tokens) == choice.text
        assert all(len(top) <= 2 and max(top.values()) >= chosen - 1e-5
                   for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert out.usage.completion_tokens == 24
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the top one


@pytest.mark.parametrize("request_body, param, message", [
    (dict(prompt="x " * 400, max_tokens=4), "prompt", "shorten it to at most 127 tokens"),
    (dict(prompt="x", max_tokens=0), "max_tokens", "max_tokens = 0 is invalid"),
    (dict(prompt="x", temperature=5), "temperature", "temperature = 5"),
    (dict(prompt="x", top_p=1.5), "top_p", "top_p = 1.5"),
    (dict(prompt="x", presence_penalty=-3), "presence_penalty", "presence_penalty = -3"),
    (dict(prompt="x", logprobs=50), "logprobs", "logprobs"),
    (dict(prompt="x", n=0), "n", "n"),
    (dict(prompt="x", best_of=3), "best_of", "best_of is not supported"),
    (dict(prompt=""), "prompt", "prompt is empty"),
    (dict(prompt="x", model="gpt-4"), "model", "model 'gpt-4' is not served here"),
    (dict(prompt=[1, 512]), "prompt", "prompt token id = 512 is invalid: token ids go from 0 to 511"),
    (dict(prompt=[[3], [-1]]), "prompt", "prompt token id = -1 is invalid"),
    (dict(prompt="x", max_tokens=128), "max_tokens", "max_tokens = 128 is invalid: the model's context is 128 "
                                                     "tokens and the prompt has 1; ask for at most 127"),
    (dict(prompt="x", seed=2**64), "seed", "seed = 18446744073709551616 is invalid"),
    (dict(prompt="x", top_k=10**30), "top_k", "top_k = 1000000000000000000000000000000 is invalid"),
    (dict(prompt="x", stop=list("abcde")), "stop", "give at most 4 stop strings"),
    (dict(prompt="x", stop_token_ids=[600]), "stop_token_ids", "stop_token_ids = 600 is invalid"),
    (dict(prompt=["x"] * 20, n=16), "n", "n = 16 is invalid: the request asks for 320 sequences"),
    (dict(prompt="x", max_tokens=True), "max_tokens", "max_tokens: Input should be a valid integer"),
    (dict(prompt="x", n="2"), "n", "n: Input should be a valid integer"),
], ids=["too-long", "max-tokens-0", "temperature", "top-p", "penalty", "logprobs", "n", "best-of", "empty",
        "unknown-model", "token-id-past-vocab", "token-id-negative", "past-context", "seed", "top-k", "stops",
        "stop-token-ids", "queue", "max-tokens-true", "n-string"])
def test_invalid_requests_get_400_with_openai_error_json(client, server, request_body, param, message):
    body = {"model": MODEL, **request_body}
    not_openais = {name: body.pop(name) for name in ("top_k", "stop_token_ids") if name in body}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**body, extra_body=not_openais)
    assert caught.value.status_code == 400
    error = caught.value.body
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert httpx.get(f"{server[0]}/health").status_code == 200


@pytest.mark.parametrize("request_body, param, message", [
    (dict(max_completion_tokens=0), "max_completion_tokens", "max_tokens = 0 is invalid"),
    (dict(max_tokens=200), "max_tokens", "max_tokens = 200 is invalid: the model's context is 128"),
    (dict(top_logprobs=3), "top_logprobs", "top_logprobs = 3 is invalid without logprobs"),
    (dict(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), "messages", "messages.0.content"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages", "of type ['image_url']"),
    (dict(messages=[{"role": "user", "content": "x " * 200}]), "messages", "shorten it to at most 127 tokens"),
], ids=["max-completion-tokens-0", "past-context", "top-logprobs-alone", "part-not-text", "image-part", "too-long"])
def test_invalid_chat_requests_get_400_naming_the_field(server, request_body, param, message):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **request_body}
    response = httpx.post(f"{server[0]}/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and message in error["message"], error


def test_malformed_json_and_oversize_body_get_400(server):
    url = f"{server[0]}/v1/completions"
    response = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(url, json={"model": MODEL, "prompt": "x" * (2 << 20)})
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the body is sent chunked, and counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"x" * (64 << 10)
        yield b'"}'

    response = httpx.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_large", response.json()
    assert httpx.get(f"{server[0]}/health").status_code == 200


def test_api_key_and_full_queue(run_dir):
    with live_server(run_dir, api_key="sesame", max_queue=2, max_batch=2) as (url, service):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert client.models.list().data[0].id == MODEL
        with pytest.raises(openai.BadRequestError) as caught:  # more than the whole queue: never fits, not 429
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=3)
        assert caught.value.body["param"] == "n" and "more than this server's queue of 2" in caught.value.body["message"]
        service.engine.num_waiting = lambda: 1  # one sequence waits already: two more do not fit now
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2)
        assert caught.value.status_code == 429 and "queue is full" in caught.value.body["message"]
        assert httpx.get(f"{url}/health").status_code == 200  # health needs no key


def test_client_that_leaves_mid_stream_frees_its_slot(server, monkeypatch):
    url, service = server
    engine = service.engine
    decode = engine.decode

    def decode_slowed_until_cancelled(batch):
        # 100 tokens take well under a second: unslowed, the answer could end by length before the
        # server notices that the client left. Slowed, not held: the server notices a client that
        # left when it next sends it a token, so tokens must keep coming: 50 ms per token made (a
        # speculative step makes several: under --speculate ngram a looping answer took 9 a step and
        # ended before the client had read its first), 100 x 50 ms = 5 s at most.
        made = sum(len(seq.output_ids) for seq in batch.seqs)
        decode(batch)
        if not engine.scheduler.cancelled:
            time.sleep(0.05 * (sum(len(seq.output_ids) for seq in batch.seqs) - made))

    monkeypatch.setattr(engine, "decode", decode_slowed_until_cancelled)
    submitted = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda *args, **kwargs: submitted.append(submit(*args, **kwargs))
                        or submitted[-1])
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 100, "stream": True, "ignore_eos": True,
            "temperature": 0}  # greedy: a sampled answer could hold back its text (bytes of a character) to the end
    with httpx.stream("POST", f"{url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
        (seq,) = submitted  # the answer: a failure below says how it ended, had it ended before the client left
    # The answer would end by length after at least 100 x 50 ms; under load, or with a slower step
    # (int8 weights), that is past 5 s, so the wait is longer and the test asks how this answer ended.
    deadline = time.monotonic() + 15
    while service.engine.num_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.engine.num_running() == 0
    assert (seq.finish_reason, len(seq.output_ids) < 100) == ("cancelled", True), (seq.finish_reason, seq.output_ids)


def test_health_and_prometheus_metrics(client, server):
    client.completions.create(model=MODEL, prompt="x", max_tokens=3)
    assert httpx.get(f"{server[0]}/health").json()["status"] == "ok"
    text = httpx.get(f"{server[0]}/metrics").text
    for name in ("shardwise_requests_total", "shardwise_generated_tokens_total", "shardwise_queue_depth",
                 "shardwise_request_latency_seconds_bucket", "shardwise_time_to_first_token_seconds_count"):
        assert name in text
    assert 'route="/v1/completions",status="200"' in text


def test_load_64_clients_512_requests_lose_nothing(client, server):
    prompts = [f"def f{i}(x):\n    return " for i in range(512)]

    def ask(prompt):
        start = time.perf_counter()
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        return time.perf_counter() - start, out.choices[0].finish_reason, out.usage.completion_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(ask, prompts))
    wall = time.perf_counter() - start
    latencies = sorted(r[0] for r in results)
    assert len(results) == 512 and all(r[1] in ("stop", "length") for r in results)
    tokens = sum(r[2] for r in results)
    print(f"\nload: 512 requests, 64 clients: p50 {latencies[255]:.3f}s p99 {latencies[506]:.3f}s, "
          f"{tokens / wall:.0f} generated tokens/s, wall {wall:.1f}s")
    assert server[1].engine.num_running() == 0 and server[1].engine.num_waiting() == 0


def test_generate_batches_a_prompts_file_and_prints_json(run_dir, tmp_path, capsys):
    from shardwise.cli.main import main

    (tmp_path / "prompts.jsonl").write_text('"def main():\\n    "\n{"prompt": "import "}\n"class A"\n')
    assert main(["generate", "--run", str(run_dir), "--prompts-file", str(tmp_path / "prompts.jsonl"), "--json",
                 "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == [PROMPT, "import ", "class A"]
    assert all(r["completion_tokens"] <= 8 and r["finish_reason"] in ("stop", "length") for r in rows)
    (tmp_path / "prompts.txt").write_text("import \n\nclass A\n")
    assert main(["generate", "--run", str(run_dir), "--prompts-file", str(tmp_path / "prompts.txt"),
                 "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out == f"import {rows[1]['completion']}\n\nclass A{rows[2]['completion']}\n"


def test_generate_says_when_the_context_cut_an_answer_short(run_dir, capsys):
    """A --max-new-tokens past the 128-token context: the answer stops at the context, and the
    output says so (a warning naming the flag; `stopped_at_context` in --json), never silently."""
    from shardwise.cli.main import main

    argv = ["generate", "--run", str(run_dir), "--prompt", PROMPT, "--temperature", "0", "--device", "cpu",
            "--json", "--max-new-tokens"]
    assert main([*argv, "500"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out)
    assert row["stopped_at_context"] and row["prompt_tokens"] + row["completion_tokens"] == 128
    assert err.count("shardwise: warning:") == 1 and "of --max-new-tokens = 500 tokens" in err
    assert main([*argv, "8"]) == 0
    out, err = capsys.readouterr()
    assert not json.loads(out)["stopped_at_context"] and "warning" not in err


@pytest.mark.parametrize("content, message", [
    ("", "has no prompts"), ('{"text": 1}\n', "line 1 has no prompt string"), ("{oops\n", "line 1 is not JSON"),
])
def test_bad_prompts_files_are_one_line_errors(run_dir, tmp_path, capsys, content, message):
    from shardwise.cli.main import main

    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(SystemExit) as caught:
        main(["generate", "--run", str(run_dir), "--prompts-file", str(tmp_path / "p.jsonl")])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and message in err and err.count("\n") == 1, err


def test_convert_keeps_the_chat_template_both_ways(run_dir, tmp_path):
    from shardwise.convert import export_run_to_hf, import_hf_to_run

    hf = export_run_to_hf(run_dir, tmp_path / "hf")
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    imported = import_hf_to_run(hf, tmp_path / "imported")
    assert json.loads((imported / "tokenizer_config.json").read_text())["chat_template"] == template
    assert load_chat_template(imported).render([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    again = export_run_to_hf(imported, tmp_path / "hf2")
    assert (again / "tokenizer_config.json").is_file()


def test_echo_puts_the_prompt_before_the_completion(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain


def test_health_says_503_when_the_engine_has_stopped(run_dir):
    with live_server(run_dir, max_batch=2) as (url, service):
        assert httpx.get(f"{url}/health").status_code == 200
        service.engine.stop()
        response = httpx.get(f"{url}/health")
        assert response.status_code == 503 and response.json()["status"] == "engine stopped"


def test_an_engine_failure_fails_only_its_request_and_the_next_is_served(run_dir, caplog):
    """A step that raises answers its request 500 with an error id, which the server log's line names;
    the engine goes on: /health stays 200 and the next request is answered."""
    with live_server(run_dir, max_batch=2) as (url, service):
        runner = service.engine.runner
        faults = iter([RuntimeError("injected: out of memory")])

        def failing_once(*args, **kwargs):
            fault = next(faults, None)
            if fault is not None:
                raise fault
            return type(runner).forward(runner, *args, **kwargs)

        runner.forward = failing_once
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as caught:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert caught.value.status_code == 500 and caught.value.body["code"] == "engine_failed"
        error_id = caught.value.body["message"].split("error id ")[1].split(";")[0]
        logged = [r.getMessage() for r in caplog.records if r.name == "shardwise.engine"]
        assert len(logged) == 1 and f"error id {error_id}" in logged[0] and "injected: out of memory" in logged[0]
        assert httpx.get(f"{url}/health").status_code == 200
        answer = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4 and answer.choices[0].finish_reason == "length"


def test_steps_failing_in_a_row_stop_the_engine_503_and_health_says_so(run_dir):
    from shardwise.generation.engine import MAX_FAILED_STEPS

    with live_server(run_dir, max_batch=2) as (url, service):
        def broken(*args, **kwargs):
            raise RuntimeError("injected: the device is lost")

        service.engine.runner.forward = broken
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for _ in range(MAX_FAILED_STEPS):
            with pytest.raises(openai.InternalServerError):
                client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert caught.value.status_code == 503
        assert httpx.get(f"{url}/health").status_code == 503


@pytest.mark.parametrize("flags, message", [
    (dict(context_len=129), "--context-len = 129 is invalid: the model's max_seq_len is 128"),
    (dict(max_batch=10**9), "--max-batch = 1000000000 is invalid: 1000000000 slots of 128 tokens need"),
    (dict(prefix_cache_mb=2**40), f"--prefix-cache-mb = {2**40} is invalid: its pool beside the KV cache"),
], ids=["context-len", "max-batch", "prefix-cache"])
def test_serving_flags_past_what_the_model_or_machine_allows_are_errors(run_dir, flags, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        open_engine(run_dir, device_name="cpu", **flags)


def test_an_encoder_decoder_run_serves_span_fills(tmp_path, data_cache):
    """A T5 run through the live server: the prompt goes to the encoder with its sentinels as typed
    (and end-of-text after it, as T5 was trained), the completion keeps the sentinels, and greedy
    decoding equals the model's own uncached greedy loop."""
    from shardwise.data.spelled_specials import EncoderInputTokenizer
    from shardwise.data.tokenizer import eos_id
    from shardwise.infer.load import load_run

    run = tmp_path / "t5"
    train(load_config(overrides={
        "model.preset": "t5-debug", "model.max_seq_len": 64, "data.source": "stdlib", "data.vocab_size": 512,
        "data.max_corpus_bytes": 200_000, "data.cache_dir": data_cache, "train.steps": 20,
        "train.global_batch_size": 8, "train.micro_batch_size": 8, "train.seq_len": 64, "train.warmup_steps": 2,
        "train.lr": 1e-2, "train.sample_tokens": 0, "run.dir": str(run), "run.progress": False, "run.name": MODEL,
    }))
    text = "def <extra_id_0>(self):\n    return <extra_id_1>"
    with live_server(run, max_batch=2) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0)
    _, model, tokenizer = load_run(run)
    eos = eos_id(tokenizer)
    prompt_ids = EncoderInputTokenizer(tokenizer, eos).encode(text).ids
    assert prompt_ids[-1] == eos and tokenizer.token_to_id("<extra_id_1>") in prompt_ids
    assert answer.usage.prompt_tokens == len(prompt_ids)
    want = model.greedy_generate(torch.tensor([prompt_ids]), 12, eos_id=eos)[0, 1:].tolist()
    want = want[:want.index(eos)] if eos in want else want
    assert answer.choices[0].text == tokenizer.decode(want, skip_special_tokens=False)
    assert "<extra_id_" in answer.choices[0].text
