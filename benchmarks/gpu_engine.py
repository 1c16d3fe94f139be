"""The serving engine on a GPU (issue 18 item 1, issue 20 item 6): greedy decoding, eager and compiled
(CUDA graphs), equals the model's own uncached loop, for decoders (Llama with grouped-query
attention, MoE) and T5 (v1.0 and v1.1 shapes), also from the engine thread. Part of
`benchmarks/gpu_session.sh`; one line per case, with the compiled decode step's time.

    python3 benchmarks/gpu_engine.py [cpu]     # cpu: the same checks here, without CUDA graphs
"""

import sys
import time

import torch

from shardwise.config.presets import model_config
from shardwise.generation.engine import engine_for_model, generate_all
from shardwise.generation.sampling import SamplingParams
from shardwise.models.llama.model import build_model as build_llama
from shardwise.models.t5.model import build_model as build_t5


DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


class Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def decoder_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids], device=DEVICE))[0, -1].argmax()))
    return ids[len(prompt):]


def check(name: str, model, prompts, want, num_tokens: int, eos_id) -> None:
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=eos_id is None)
    for compile in (False, True):
        t = time.time()
        engine = engine_for_model(model, Tok(), eos_id=eos_id, max_batch=4, compile=compile)
        got = [s.output_ids for s in generate_all(engine, prompts, params)]
        steps = engine.stats["decode_steps"]
        start = time.perf_counter()
        generate_all(engine, prompts, params)  # warm now: the step's time
        per_step = (time.perf_counter() - start) / (engine.stats["decode_steps"] - steps)
        engine.start()  # the engine thread too (CUDA graphs replay there)
        seq = engine.submit(prompts[3], params, lambda out: None)
        while seq.finish_reason is None:
            time.sleep(0.01)
        engine.stop()
        print(name, "compile", compile, "equal", got == want, "thread equal", seq.output_ids == want[3],
              f"{per_step * 1e3:.2f} ms/step", round(time.time() - t, 1), "s", flush=True)


g = torch.Generator().manual_seed(0)
for preset in ("debug", "moe-debug"):
    cfg = model_config(preset, init_std=0.2)  # a large init makes greedy outputs varied; both have 4 heads, 2 kv heads
    model = build_llama(cfg, device=DEVICE, seed=1).eval()
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 37, 9, 30, 3, 12)]
    check(preset, model, prompts, [decoder_greedy(model, p, 40) for p in prompts], 40, None)
for gated in (False, True):
    cfg = model_config("t5-debug", gated_mlp=gated, tie_embeddings=not gated, max_seq_len=64)
    model = build_t5(cfg, device=DEVICE, seed=0).eval()
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12)]
    want = [model.greedy_generate(torch.tensor([p], device=DEVICE), 12, eos_id=1)[0, 1:].tolist() for p in prompts]
    check(f"t5 gated={gated}", model, prompts, want, 12, 1)
