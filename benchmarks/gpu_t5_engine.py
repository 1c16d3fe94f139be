"""T5 through the serving engine on a GPU (issue 20 item 6): eager, compiled (CUDA graphs) and from the
engine thread, greedy decoding equals the model's own uncached loop, v1.0 and v1.1. Part of
`benchmarks/gpu_session.sh`; one line per case.

    python3 benchmarks/gpu_t5_engine.py
"""

import time

import torch

from shardwise.config.model import model_config
from shardwise.models.t5.model import build_model
from shardwise.generation.engine import engine_for_model, generate_all
from shardwise.generation.sampling import SamplingParams


class Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


for gated in (False, True):
    cfg = model_config("t5-debug", gated_mlp=gated, tie_embeddings=not gated, max_seq_len=64)
    model = build_model(cfg, device="cuda", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 3, 12)]
    params = SamplingParams(max_tokens=12, temperature=0)
    want = [model.greedy_generate(torch.tensor([p], device="cuda"), 12, eos_id=1)[0, 1:].tolist() for p in prompts]
    for compile in (False, True):
        t = time.time()
        engine = engine_for_model(model, Tok(), eos_id=1, max_batch=4, compile=compile)
        got = [s.output_ids for s in generate_all(engine, prompts, params)]
        engine.start()  # the engine thread too (CUDA graphs replay there)
        seq = engine.submit(prompts[3], params, lambda out: None)
        while seq.finish_reason is None:
            time.sleep(0.01)
        engine.stop()
        print("gated", gated, "compile", compile, "equal", got == want, "thread equal", seq.output_ids == want[3],
              round(time.time() - t, 1), "s", flush=True)
