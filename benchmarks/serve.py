"""Serving throughput: shardwise's engine and server vs HF `transformers` `generate`, same weights, one process.

    python benchmarks/serve.py [--preset demo] [--new-tokens 128] [--clients 16] [--repeats 3]
    python benchmarks/serve.py --device cuda --dtype bfloat16 --preset llama3-1b --clients 32 \
        --requests-per-client 1 --capacity 512 --skip-one-by-one        # issue 18 item 5, on a GPU
    python benchmarks/serve.py --batch1-only --repeats 5               # (a) alone

(a) batch 1: one prompt, greedy, `--new-tokens` tokens: new tokens / wall time (prefill included, the
same for both), shardwise eager and with the compiled decode step, vs `model.generate`;
(b) `--clients` concurrent clients (threads of another process), each sending `--requests-per-client`
requests one after another to the live OpenAI-compatible server (the `openai` client, over HTTP; the
compiled engine), vs HF `generate` serving every request one after another, and vs HF `generate` on
`--clients` requests at a time as one left-padded batch (static batching: a batch runs until its
longest request is done). Two mixes: every request asks for `--new-tokens` ("equal_lengths"), or
requests ask for 1/4, 2/4, 3/4 or all of it ("mixed_lengths"). Figures are the tokens clients asked
for, per second.
Every figure is the median of `--repeats` runs, timed alternately. Prints one JSON object;
docs/benchmarks.md records the figures. On a GPU the compiled decode step runs under CUDA graphs
(`ModelRunner`'s "reduce-overhead"); `--capacity` bounds each slot's KV cache (a 1B Llama's
131,072-token context in 32 slots would not fit); `--skip-one-by-one` leaves out HF serving the
requests one after another (at batch 1 that is the batch-1 figure again, minutes of GPU time).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shardwise.config.presets import model_config
from shardwise.models.families import counts_of
from shardwise.generation.engine import engine_for_model, generate_all
from shardwise.generation.sampling import SamplingParams
from shardwise.models.llama.hf_adapter import model_to_hf
from shardwise.models.llama.model import build_model


class IdsTokenizer:
    """Prompts are token ids here; text is not timed."""

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text):
        class Encoding:
            ids = [int(t) for t in text.split()]
        return Encoding()


def hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> int:
    """Left-padded batch generate; returns tokens generated."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(hf.device), mask.to(hf.device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0)
    return (out.shape[1] - width) * len(prompts)


def mixed_lengths(clients: int, per_client: int, new_tokens: int) -> list[int]:
    """max_tokens of each request of the mixed scenario, in sending order (request i goes to client
    i % clients, as `run_clients` shares the work): 1/4, 2/4, 3/4 or all of `new_tokens`, each
    client's successive requests cycling through the four, and every batch of `clients` consecutive
    requests (one padded HF batch) holding all four. (Before commit e487593 request i asked for
    (1 + 7i mod 4) quarters: with a client count divisible by 4 every client then asked the same
    length four times, so no client's stream varied and continuous batching had nothing to gain.)"""
    return [new_tokens * (1 + (i + i // clients) % 4) // 4 for i in range(clients * per_client)]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def live_server(engine, tokenizer):
    """The OpenAI-compatible server over `engine`, in a thread of its own; the engine steps in this
    (the main) thread while `serving` runs, as `shardwise serve` steps it."""
    import uvicorn

    from shardwise.infer.chat import ChatTemplate, PLAIN_TEMPLATE
    from shardwise.infer.server import Service, build_app

    service = Service(engine, tokenizer, "bench", ChatTemplate(PLAIN_TEMPLATE, plain=True))
    server = uvicorn.Server(uvicorn.Config(build_app(service), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, f"http://127.0.0.1:{port}/v1"


def serving(engine, fn):
    """fn() in a helper thread while the engine steps in this one (the thread that built and warmed up
    the model: on CPU a second thread running torch ops is ~2x slower per decode step, see
    `Engine.serve_forever`); what fn returns."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as err:  # re-raised in this thread
            result["error"] = err
        finally:
            engine.pause()

    helper = threading.Thread(target=run)
    helper.start()
    engine.serve_forever()
    helper.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def run_clients(url: str, work: list[tuple[list[int], int]], num_clients: int) -> float:
    """Seconds for `num_clients` threads to get every (prompt, max_tokens) of `work` answered; each
    thread sends its share one request after another."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)

    def ask(item):
        prompt, max_tokens = item
        out = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == max_tokens

    def one_client(share):
        for item in share:
            ask(item)

    start = time.perf_counter()
    with ThreadPoolExecutor(num_clients) as pool:
        list(pool.map(one_client, [work[i::num_clients] for i in range(num_clients)]))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--capacity", type=int, default=0, help="tokens per slot's KV cache (default: the model's context)")
    parser.add_argument("--skip-one-by-one", action="store_true", help="leave out HF serving requests one by one")
    parser.add_argument("--batch1-only", action="store_true", help="measure (a) alone")
    args = parser.parse_args()

    import transformers

    cfg = model_config(args.preset)
    dtype = getattr(torch, args.dtype)
    model = build_model(cfg, device=args.device, seed=0).to(dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        model_to_hf(model, Path(tmp))
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa", dtype=dtype)
        hf = hf.to(args.device).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size, (args.prompt_len + i % 8,), generator=gen).tolist()
               for i in range(args.clients)]
    greedy = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    tokenizer = IdsTokenizer()
    # owns_model: served only (exported to HF above), so stored as `shardwise serve` stores it
    engines = {"eager": engine_for_model(model, tokenizer, eos_id=None, max_batch=args.clients,
                                         capacity=args.capacity or None, owns_model=True),
               "compiled": engine_for_model(model, tokenizer, eos_id=None, max_batch=args.clients,
                                            capacity=args.capacity or None, compile=True, owns_model=True)}

    # Same greedy tokens first: the comparison is of the same work.
    ours = generate_all(engines["eager"], [prompts[0]], greedy)[0].output_ids
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([prompts[0]], device=hf.device), max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=0)[0, len(prompts[0]):].tolist()
    same_tokens = ours == theirs

    batch1 = {"shardwise_eager": [], "shardwise_compiled": [], "transformers": []}
    for name in ("eager", "compiled"):  # warm-up: compile for one row (dynamo specialises size 1) and for many
        generate_all(engines[name], prompts[:1], greedy)
        generate_all(engines[name], prompts, greedy)
    hf_generate(hf, prompts[:1], 8)
    hf_generate(hf, prompts, args.new_tokens)  # and at the clients' batch size, whole (a GPU's first batch pays its set-up)
    for _ in range(args.repeats):
        for name in ("eager", "compiled"):
            batch1[f"shardwise_{name}"].append(timed(lambda: generate_all(engines[name], [prompts[0]], greedy)))
        batch1["transformers"].append(timed(lambda: hf_generate(hf, [prompts[0]], args.new_tokens)))
    batch1_tps = {k: args.new_tokens / statistics.median(v) for k, v in batch1.items()}
    report = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
                   f"{torch.__version__}" + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        "model": f"{args.preset}: {counts_of(cfg).num_params() / 1e6:.1f}M parameters, {args.dtype}",
        "greedy_tokens_equal_transformers": same_tokens,
        # in bf16 two correct implementations may round one logit differently and part ways
        "greedy_tokens_common_prefix": common_prefix(ours, theirs),
        "batch1_tokens_per_s": {k: round(v, 1) for k, v in batch1_tps.items()},
        "batch1_speedup_vs_transformers": {k: round(v / batch1_tps["transformers"], 2) for k, v in batch1_tps.items()
                                           if k != "transformers"},
    }
    if args.batch1_only:
        print(json.dumps(report, indent=1))
        return

    engine = engines["compiled"]
    server, thread, url = live_server(engine, tokenizer)
    # The clients run in another process, as real clients do: in this one they would take the
    # interpreter lock from the server and the engine.
    clients = multiprocessing.get_context("spawn").Pool(1)

    # Each of --clients clients sends --requests-per-client requests, one after another (a closed loop).
    # equal: every request asks for --new-tokens; mixed: 1/4, 2/4, 3/4 or all of it, as real traffic varies.
    per_client = args.requests_per_client
    scenarios = {"equal_lengths": [args.new_tokens] * (args.clients * per_client),
                 "mixed_lengths": mixed_lengths(args.clients, per_client, args.new_tokens)}
    work = [(prompts[i % args.clients], n) for i, n in enumerate(scenarios["mixed_lengths"])]

    def padded_batches(work):
        """Static batching: --clients requests at a time, each batch until its longest request is done."""
        for start in range(0, len(work), args.clients):
            batch = work[start:start + args.clients]
            hf_generate(hf, [p for p, _ in batch], max(n for _, n in batch))

    serving(engine, lambda: clients.apply(run_clients, (url, work[:args.clients], args.clients)))  # warm-up
    many_tps = {}
    for scenario, lengths in scenarios.items():
        work = [(prompts[i % args.clients], n) for i, n in enumerate(lengths)]
        times = {"shardwise_server": [], "transformers_one_by_one": [], "transformers_padded_batch": []}
        for _ in range(args.repeats):
            served = serving(engine, lambda: clients.apply(run_clients, (url, work, args.clients)))
            times["shardwise_server"].append(served)
            if not args.skip_one_by_one:
                times["transformers_one_by_one"].append(timed(lambda: [hf_generate(hf, [p], n) for p, n in work]))
            times["transformers_padded_batch"].append(timed(lambda: padded_batches(work)))
        many_tps[scenario] = {k: sum(lengths) / statistics.median(v) for k, v in times.items() if v}
    clients.close()
    server.should_exit = True
    thread.join()
    engine.stop()

    print(json.dumps({
        **report,
        f"{args.clients}_clients_useful_tokens_per_s": {
            scenario: {k: round(v, 1) for k, v in tps.items()} for scenario, tps in many_tps.items()},
        f"{args.clients}_clients_server_speedup": {scenario: {
            f"vs_{name}": round(tps["shardwise_server"] / tps[name], 2) for name in tps if name != "shardwise_server"
        } for scenario, tps in many_tps.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
