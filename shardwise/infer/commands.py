"""`shardwise generate` and `shardwise serve`: both open a run as an engine (`load.open_engine`),
one code path for generation, on one process or tensor-parallel over `--nproc N`."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from shardwise.generation.engine import generate_all
from shardwise.generation.sampling import SamplingParams
from shardwise.infer.load import open_engine


DEFAULT_PROMPT = "def "


def read_prompts(args) -> list[str]:
    """`--prompt`, or `--prompts-file`: one prompt per line, or a .jsonl file of strings or {"prompt": ...}."""
    if not args.prompts_file:
        return [DEFAULT_PROMPT if args.prompt is None else args.prompt]
    path = Path(args.prompts_file)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts-file {str(path)!r} does not exist; give a text file with one prompt per line")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--prompts-file {str(path)!r} has no prompts; write one per line")
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--prompts-file {str(path)!r} line {number} is not JSON ({err.msg}); write a JSON "
                             "string or {\"prompt\": ...} per line") from None
        prompt = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(prompt, str):
            raise ValueError(f"--prompts-file {str(path)!r} line {number} has no prompt string; write a JSON string "
                             "or {\"prompt\": ...} per line")
        prompts.append(prompt)
    return prompts


GENERATE_FLAG_NAMES = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
                       "top_p": "--top-p"}


def sampling_of(args) -> SamplingParams:
    """`shardwise generate`'s sampling flags, checked (errors name the flags)."""
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    return params.check(None, GENERATE_FLAG_NAMES)


def generate_results(args) -> list[dict]:
    """Every prompt's completion, on every rank (tensor parallel: rank 0 generates, then shares)."""
    import torch.distributed as dist

    prompts = read_prompts(args)
    params = sampling_of(args)
    _, engine, tokenizer = open_engine(Path(args.run), device_name=args.device,
                                       checkpoint=args.checkpoint and Path(args.checkpoint),
                                       max_batch=min(args.max_batch, len(prompts)),
                                       prefix_cache_mb=args.prefix_cache_mb, quantize=args.quantize,
                                       group_size=args.group_size,
                                       speculate=args.speculate, num_speculative_tokens=args.num_speculative_tokens)
    leader = not dist.is_initialized() or dist.get_rank() == 0
    results = None
    if leader:
        try:
            ids = [tokenizer.encode(prompt).ids for prompt in prompts]
            seqs = generate_all(engine, ids, params)
            results = [{"prompt": prompt, "completion": seq.text, "finish_reason": seq.finish_reason,
                        "prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output_ids),
                        "cached_tokens": seq.num_reused,
                        "stopped_at_context": stopped_at_context(seq, params, engine.context_len),
                        **speculation_counts(seq, args.speculate)}
                       for prompt, seq in zip(prompts, seqs)]
        finally:
            engine.runner.close()
    else:
        engine.runner.follow()
    if dist.is_initialized():
        shared = [results]
        dist.broadcast_object_list(shared, src=0)
        results = shared[0]
    return results


def speculation_counts(seq, speculate: str | None) -> dict:
    """A speculating run's draft tokens proposed and accepted for one prompt, and their ratio (None: none proposed)."""
    from shardwise.generation.speculation import acceptance_rate

    if speculate is None:
        return {}
    state, rate = seq.speculation, acceptance_rate(seq)
    return {"draft_tokens_proposed": state.proposed if state else 0, "draft_tokens_accepted": state.accepted if state else 0,
            "acceptance_rate": None if rate is None else round(rate, 4)}


def stopped_at_context(seq, params: SamplingParams, context_len: int) -> bool:
    """Whether the answer ended because prompt and answer filled the model's context, short of
    --max-new-tokens: the answer is cut on purpose, and the output says so."""
    return (seq.finish_reason == "length" and len(seq.output_ids) < params.max_tokens
            and len(seq.prompt_ids) + len(seq.output_ids) >= context_len)


def warn_of_cut_answers(results: list[dict], max_new_tokens: int) -> None:
    for number, result in enumerate(results, 1):
        if result["stopped_at_context"]:
            total = result["prompt_tokens"] + result["completion_tokens"]
            print(f"shardwise: warning: prompt {number}'s answer stopped after {result['completion_tokens']} of "
                  f"--max-new-tokens = {max_new_tokens} tokens: prompt and answer fill the model's context "
                  f"({total} tokens)", file=sys.stderr, flush=True)


def generate_text(args) -> str:
    """What `shardwise generate` prints: each prompt and its completion (blank line between), or JSON lines
    (an answer cut at the model's context is named on stderr, and by `stopped_at_context` in JSON)."""
    import torch.distributed as dist

    results = generate_results(args)
    if not dist.is_initialized() or dist.get_rank() == 0:  # every rank has the results: one says it
        warn_of_cut_answers(results, args.max_new_tokens)
    if args.json:
        return "\n".join(json.dumps(result, ensure_ascii=False) for result in results)
    return "\n\n".join(result["prompt"] + result["completion"] for result in results)


SERVING_PACKAGES = ("fastapi", "uvicorn", "jinja2", "prometheus_client")


def serve(args) -> None:
    """Open the run and serve it until interrupted; ranks other than 0 follow rank 0's engine."""
    import torch.distributed as dist

    import importlib.util

    missing = [name for name in SERVING_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"shardwise serve needs the serving packages ({', '.join(missing)} missing); "
                         "install them with: pip install 'shardwise[serve]'")
    import uvicorn
    from shardwise.infer.chat import load_chat_template
    from shardwise.infer.server import Service, build_app

    cfg, engine, tokenizer = open_engine(Path(args.run), device_name=args.device, max_batch=args.max_batch,
                                         checkpoint=args.checkpoint and Path(args.checkpoint),
                                         prefill_chunk=args.prefill_chunk, context_len=args.context_len,
                                         compile=args.compile, prefix_cache_mb=args.prefix_cache_mb,
                                         quantize=args.quantize, group_size=args.group_size,
                                         speculate=args.speculate, num_speculative_tokens=args.num_speculative_tokens)
    if dist.is_initialized() and dist.get_rank() != 0:
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # the launcher passes a stop signal to every rank
        try:
            engine.runner.follow()
        except KeyboardInterrupt:
            pass
        return
    service = Service(engine, tokenizer, args.model_name or cfg.run.name, load_chat_template(Path(args.run)),
                      api_key=args.api_key or os.environ.get("SHARDWISE_API_KEY"), max_queue=args.max_queue)
    # lifespan off: the app has no start-up or shutdown hooks, and a forced stop (a second Ctrl-C)
    # would otherwise cancel the waiting lifespan task and print its traceback
    server = uvicorn.Server(uvicorn.Config(build_app(service), host=args.host, port=args.port, log_level="warning",
                                           lifespan="off"))
    http = start_http_server(server, args)
    stop_on_signals(server)
    # The engine steps here, in the main thread, which built the model: on CPU a second thread running
    # torch ops made each decode step ~2x slower (Engine.serve_forever says why). It returns once the
    # HTTP server has ended, after a signal and uvicorn's drain of the requests still open.
    threading.Thread(target=lambda: (http.join(), engine.pause()), name="shardwise-http-watch", daemon=True).start()
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    where = f"tensor parallel over {ranks} processes" if ranks > 1 else "one process"
    print(f"shardwise: serving {service.model_name!r} on http://{args.host}:{args.port}/v1 — {engine.max_batch} "
          f"slots of {engine.context_len} tokens, {where}; Ctrl-C stops", file=sys.stderr, flush=True)
    try:
        engine.serve_forever()
        while http.is_alive():  # the engine failed: the server answers 503 until a signal stops it
            http.join(0.5)
    finally:
        engine.stop()
    print("shardwise: server stopped", file=sys.stderr, flush=True)


def start_http_server(server, args) -> threading.Thread:
    """uvicorn in a thread of its own (it installs no signal handlers there), once it listens."""
    def run() -> None:
        try:
            server.run()
        except SystemExit:  # uvicorn's exit on a failed start, after logging why: reported below
            pass

    http = threading.Thread(target=run, name="shardwise-http", daemon=True)
    http.start()
    while not server.started:
        if not http.is_alive():  # uvicorn logged why (most often: the port is taken)
            raise ValueError(f"--host {args.host} --port {args.port}: the server could not listen there; "
                             "pick a free port with --port")
        http.join(0.02)
    return http


def stop_on_signals(server) -> None:
    """SIGINT or SIGTERM: uvicorn stops taking requests and finishes those open (the engine keeps
    stepping for them); a second SIGINT or SIGTERM closes them at once, as uvicorn does in its own thread."""
    def on_signal(signum, frame):
        server.force_exit = server.should_exit
        server.should_exit = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
