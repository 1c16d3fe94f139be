"""Generation: the engine (continuous batching over a static-slot KV cache), sampling, stop strings.
Below `train` (its closing sample generates through it) and `infer` (which opens runs and serves)."""
