"""The server fuzzed in-process: schemathesis from its own OpenAPI schema (FastAPI's /openapi.json),
and hypothesis with request bodies of /v1/completions and /v1/chat/completions that mix plausible
values with wrong types, NaN, huge numbers, token ids past the vocabulary and unknown fields.

Every answer must be below 500 and arrive within `ANSWER_WITHIN_S`; every 400 is OpenAI's error JSON
naming the request field; /health answers 200 after each request. The app runs over a one-step
(untrained) debug model whose context is 64 tokens, so that every generation is cheap. The runs are
bounded and reproducible: a fixed number of examples, derandomized, no example database.
"""

import collections
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardwise.config.loader import load_config
from shardwise.infer.chat import load_chat_template
from shardwise.infer.load import open_engine
from shardwise.infer.server import Service, build_app
from shardwise.train.trainer import train

schemathesis = pytest.importorskip("schemathesis")
from starlette.testclient import TestClient  # noqa: E402  (after the skip: the serving extra brings starlette)

MODEL = "tiny"
CONTEXT = 64
EXAMPLES_PER_ROUTE = 600  # hypothesis, per route
SCHEMA_EXAMPLES = 400  # schemathesis, per generation mode (positive, negative): 2,000 examples in all
ANSWER_WITHIN_S = 30
FUZZ_SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                            HealthCheck.data_too_large, HealthCheck.filter_too_much])

pytestmark = pytest.mark.slow  # ~2,000 requests through the engine: tens of seconds on 2 cores


@pytest.fixture(scope="module")
def app(tmp_path_factory, data_cache):
    run = tmp_path_factory.mktemp("fuzz") / "run"
    train(load_config(overrides={
        "model.preset": "debug", "model.max_seq_len": CONTEXT, "data.source": "stdlib", "data.vocab_size": 512,
        "data.max_corpus_bytes": 50_000, "data.cache_dir": data_cache, "train.steps": 1,
        "train.global_batch_size": 2, "train.micro_batch_size": 2, "train.seq_len": 32, "train.warmup_steps": 0,
        "train.sample_tokens": 0, "run.dir": str(run), "run.progress": False, "run.name": MODEL,
    }))
    _, engine, tokenizer = open_engine(run, device_name="cpu", max_batch=4, prefill_chunk=32)
    engine.start()
    try:
        yield build_app(Service(engine, tokenizer, MODEL, load_chat_template(run), max_queue=32))
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as client:  # one event loop for every request
        yield client


def within_time_limit(call):
    """`call()`'s result; a request that does not end in ANSWER_WITHIN_S fails the test (the server hangs)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result(timeout=ANSWER_WITHIN_S)


def check_answer(response, body) -> None:
    assert response.status_code < 500, (body, response.text)
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
        if isinstance(body, dict) and not error["message"].startswith("the body is not valid JSON"):
            assert error["param"], error  # names the request field
    elif response.status_code == 200 and content_type(response).startswith("application/json"):
        for choice in response.json().get("choices", []) if isinstance(response.json(), dict) else []:
            assert choice["finish_reason"] in ("stop", "length"), choice


def content_type(response) -> str:
    value = response.headers.get("content-type", "")
    return value[0] if isinstance(value, list) else value  # schemathesis keeps a header's values as a list


def check_healthy(client, settle_s: float = 5.0) -> None:
    """/health answers 200, and every slot is free again: at once, or (the sequences of a client that
    left are cancelled at the engine's next step) within `settle_s`."""
    deadline = time.monotonic() + settle_s
    while True:
        health = client.get("/health")
        assert health.status_code == 200, health.text
        if health.json()["running"] == health.json()["waiting"] == 0:
            return
        assert time.monotonic() < deadline, health.text
        time.sleep(0.01)


# ---- hypothesis: request bodies ----

ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3),
                        max_leaves=6)
TOKEN_ID = st.integers(0, 511)
BAD_TOKEN_ID = st.integers(-3, -1) | st.integers(512, 515) | st.integers(2**63, 2**70)
STOP = st.text(min_size=1, max_size=3)

# Each field: (values the server must accept, values it must refuse or survive).
SAMPLING_FIELDS = {
    "model": (st.just(MODEL), st.text(max_size=6)),
    "max_tokens": (st.integers(1, 6), st.integers(-2, 0) | st.integers(CONTEXT - 2, CONTEXT + 2) | st.integers()),
    "temperature": (st.floats(0, 2), st.floats(-1, 0, exclude_max=True) | st.floats(2, 9, exclude_min=True)
                    | st.sampled_from([float("nan"), float("inf"), 5e-324])),
    "top_p": (st.floats(0, 1, exclude_min=True), st.floats(-0.5, 0) | st.floats(1, 9, exclude_min=True)
              | st.just(float("nan"))),
    "top_k": (st.integers(0, 512), st.integers(-3, -1) | st.integers(513, 10**30)),
    "presence_penalty": (st.floats(-2, 2), st.floats(2, 1e300, exclude_min=True) | st.just(float("-inf"))),
    "frequency_penalty": (st.floats(-2, 2), st.floats(-1e300, -2, exclude_max=True) | st.just(float("nan"))),
    "stop": (STOP | st.lists(STOP, max_size=4), st.just("") | st.lists(STOP, min_size=5, max_size=6)),
    "stop_token_ids": (st.lists(TOKEN_ID, max_size=4), st.lists(BAD_TOKEN_ID, min_size=1, max_size=2)),
    "ignore_eos": (st.booleans(), st.text(max_size=3)),
    "seed": (st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**80) | st.integers(-(2**80), -(2**63) - 1)),
    "n": (st.integers(1, 3), st.integers(-1, 0) | st.integers(17, 40)),
    "stream": (st.booleans(), st.integers(2, 9)),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), st.text(max_size=3)),
    "logit_bias": (st.dictionaries(TOKEN_ID.map(str), st.floats(-100, 100), max_size=3),
                   st.dictionaries(BAD_TOKEN_ID.map(str) | st.text(max_size=3), st.floats(-150, 150)
                                   | st.just(float("nan")), min_size=1, max_size=2)),
    "user": (st.text(max_size=4), st.integers()),
    "unknown_field": (ANY_JSON, ANY_JSON),  # OpenAI's newer fields: ignored
}
PROMPT = (st.text(min_size=1, max_size=40) | st.lists(TOKEN_ID, min_size=1, max_size=12)
          | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3)
          | st.lists(st.lists(TOKEN_ID, min_size=1, max_size=6), min_size=1, max_size=3))
COMPLETION_FIELDS = {
    **SAMPLING_FIELDS,
    "prompt": (PROMPT, st.just("") | st.just([]) | st.lists(BAD_TOKEN_ID, min_size=1, max_size=3)
               | st.just("x " * 70) | st.lists(st.lists(TOKEN_ID, max_size=2) | st.integers(), min_size=1, max_size=2)),
    "logprobs": (st.integers(0, 5) | st.none(), st.integers(-3, -1) | st.integers(21, 10**20)),
    "echo": (st.booleans(), st.floats()),
    "best_of": (st.just(1) | st.none(), st.integers(-2, 6)),
    "suffix": (st.none() | st.just(""), st.text(min_size=1, max_size=3)),
}
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                                 "content": st.text(max_size=30) | st.lists(TEXT_PART, max_size=2) | st.none()})
BAD_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["bot", ""]) | ANY_JSON,
                                     "content": ANY_JSON | st.lists(st.fixed_dictionaries(
                                         {"type": st.sampled_from(["image_url", "text"]), "text": ANY_JSON}))})
CHAT_FIELDS = {
    **SAMPLING_FIELDS,
    "messages": (st.lists(MESSAGE, min_size=1, max_size=4),
                 st.just([]) | st.lists(BAD_MESSAGE, min_size=1, max_size=2)
                 | st.just([{"role": "user", "content": "x " * 70}])),
    "logprobs": (st.booleans(), st.integers(2, 9)),
    "top_logprobs": (st.integers(0, 5), st.integers(-3, -1) | st.integers(21, 10**20)),
    "max_completion_tokens": (st.integers(1, 6), st.integers(-2, 0) | st.integers(CONTEXT, 10**20)),
    "tools": (st.none() | st.just([]), st.lists(ANY_JSON, min_size=1, max_size=2)),
    "response_format": (st.just({"type": "text"}), st.just({"type": "json_object"})),
}
REQUIRED = {"/v1/completions": ("model", "prompt"), "/v1/chat/completions": ("model", "messages")}


@st.composite
def bodies(draw, fields: dict, required: tuple[str, ...]):
    """A valid body (the required fields and any of the others), then 0 to 2 of its fields given a
    value to refuse or any JSON at all, a required field left out; or sometimes no object at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(ANY_JSON)
    optional = sorted(set(fields) - set(required))
    names = [*required, *draw(st.lists(st.sampled_from(optional), unique=True, max_size=6))]
    body = {name: draw(fields[name][0]) for name in names}
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(sorted(fields)))
        body[name] = draw(fields[name][1] | ANY_JSON)
    if draw(st.integers(0, 19)) == 0:
        body.pop(draw(st.sampled_from(required)))
    return body


def post(client, route: str, body):
    """The body as Python's json writes it, NaN and Infinity included (Starlette's parser takes them)."""
    return within_time_limit(lambda: client.post(route, content=json.dumps(body),
                                                 headers={"content-type": "application/json"}))


@pytest.mark.parametrize("route, fields", [("/v1/completions", COMPLETION_FIELDS),
                                           ("/v1/chat/completions", CHAT_FIELDS)], ids=["completions", "chat"])
def test_fuzzed_request_bodies_get_no_5xx_and_leave_the_server_healthy(client, route, fields):
    statuses = collections.Counter()

    @settings(max_examples=EXAMPLES_PER_ROUTE, **FUZZ_SETTINGS)
    @given(body=bodies(fields, REQUIRED[route]))
    def one_request(body):
        response = post(client, route, body)
        statuses[response.status_code] += 1
        check_answer(response, body)
        check_healthy(client)

    one_request()
    print(f"\nhypothesis {route}: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")


# ---- schemathesis: the OpenAPI schema ----

def cap_generation(body: dict) -> None:
    """A valid body past the model check into the engine, generating few tokens (the schema allows
    16 choices of the whole context each)."""
    body["model"] = MODEL
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int):
            body[name] = min(body[name], 4)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_finds_no_5xx_and_the_server_stays_healthy(app, client, mode):
    """Cases of every operation of the app's schema: valid ones (positive) and ones that break it
    (negative: the server must refuse them, `negative_data_rejection`); each answer as the schema
    lists (`status_code_conformance`)."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import negative_data_rejection, status_code_conformance

    api_schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    checks = [not_a_server_error, status_code_conformance, negative_data_rejection]

    statuses = collections.Counter()

    @settings(max_examples=SCHEMA_EXAMPLES, **FUZZ_SETTINGS)
    @given(case=api_schema.as_strategy(GenerationMode(mode)))
    def one_case(case):
        if mode == "positive" and isinstance(case.body, dict):
            cap_generation(case.body)
        response = within_time_limit(case.call)
        statuses[f"{case.method} {case.path} {response.status_code}"] += 1
        case.validate_response(response, checks=checks)
        check_answer(response, case.body)
        check_healthy(client)

    one_case()
    print(f"\nschemathesis {mode}: {sum(statuses.values())} requests, {dict(sorted(statuses.items()))}")
