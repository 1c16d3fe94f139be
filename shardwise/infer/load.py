"""Open a run directory for inference: its config, its tokenizer, its newest (or a named) checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from shardwise.config.loader import load_config
from shardwise.config.schema import Config
from shardwise.models.build import build_on_meta, plan_of
from shardwise.models.families import spec_of
from shardwise.checkpoint.store import load_model_weights, newest_valid_checkpoint
from shardwise.distributed.lora_layout import build_adapted_on_meta, lora_options
from shardwise.models.common.lora import is_adapter_name, merge_adapters


def read_run_config(run_dir: Path) -> Config:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"--run {str(run_dir)!r} has no config.json; pass a directory written by `shardwise train`")
    return load_config(path)


def check_checkpoint_of_run(checkpoint: Path, run_dir: Path) -> None:
    """A `--checkpoint` is one of the run's own: its weights belong with the run's config and tokenizer."""
    listing = f"list them with `shardwise checkpoints {run_dir}`"
    if not checkpoint.is_dir():
        what = "is not a directory" if checkpoint.exists() else "does not exist"
        raise FileNotFoundError(f"--checkpoint {str(checkpoint)!r} {what}; pass a checkpoint directory of the run "
                                f"({listing})")
    if checkpoint.resolve().parent != (run_dir / "checkpoints").resolve():
        raise ValueError(f"--checkpoint {str(checkpoint)!r} is not a checkpoint of --run {str(run_dir)!r} (its "
                         f"config and tokenizer belong to another run); pass one of {run_dir / 'checkpoints'} "
                         f"({listing}), or --run the run it came from")


def load_run(run_dir: Path, *, device="cpu", checkpoint: Path | None = None, tp_mesh=None, merge: bool = True):
    """(config, model in eval mode, tokenizer) of a trained run, from a checkpoint of any layout
    (an image model's tokenizer is None). With `tp_mesh` (every rank of it calls this) the model
    is tensor-parallel over it. A LoRA run's model is its base with the adapters folded in, or with
    `merge=False` the base (frozen) beside its adapters, under their own names (for export)."""
    from shardwise.data.tokenizer import load_tokenizer

    run_dir = Path(run_dir)
    cfg = read_run_config(run_dir)
    if checkpoint is not None:
        check_checkpoint_of_run(Path(checkpoint), run_dir)
    checkpoint = checkpoint or newest_valid_checkpoint(run_dir)
    if checkpoint is None:
        raise ValueError(f"--run {str(run_dir)!r} has no checkpoint yet; train it (checkpoint.at_end = true) first")
    if lora_options(cfg.train) is not None and not cfg.checkpoint.quantization:  # quantized: merged already
        model = load_adapted_model(cfg, checkpoint, device=device, merge=merge)
        tensor_parallel(model, cfg, tp_mesh)  # split whole: the merged weights exist on every rank
    else:
        model = build_on_meta(cfg.model)
        tensor_parallel(model, cfg, tp_mesh)  # each rank then reads only its share of the checkpoint
        quantized_layout(model, cfg)
        model.to_empty(device=device)
        load_model_weights(checkpoint, model)
        if cfg.checkpoint.quantization:
            from shardwise.generation.quantize import prepare_kernels

            prepare_kernels(model)
    tokenizer = None if spec_of(cfg.model.family).image_input else load_tokenizer(run_dir / "tokenizer.json")
    return cfg, model.eval(), tokenizer


def tensor_parallel(model, cfg: Config, tp_mesh) -> None:
    """The model split over `tp_mesh` (nothing without one)."""
    if tp_mesh is None:
        return
    from shardwise.core.layout_checks import check_tensor_parallel
    from shardwise.distributed.tensor_parallel import apply_tp

    check_tensor_parallel(cfg.model, spec_of(cfg.model.family), tp=tp_mesh.size(), sp=False, seq_len=cfg.model.max_seq_len)
    apply_tp([model], plan_of(cfg.model), tp_mesh, sp=False)


def quantized_layout(model, cfg: Config) -> None:
    """A run written by `shardwise quantize`: its linears become quantized ones (on meta) before the
    checkpoint's codes are loaded into them."""
    if cfg.checkpoint.quantization:
        from shardwise.generation.quantize import quantize_model

        quantize_model(model, cfg.checkpoint.quantization, cfg.checkpoint.quantization_group_size or None,
                       group_size_flag="the run's checkpoint.quantization_group_size (`shardwise quantize --group-size`)")


def load_adapted_model(cfg: Config, checkpoint: Path, *, device, merge: bool):
    """A LoRA run's model: its base (train.init_from's weights, or the seeded initial ones, held in
    train.lora_base_dtype as in training), then the checkpoint's adapters, folded into the base
    linears unless `merge` is False."""
    model = build_adapted_on_meta(cfg)
    model.to_empty(device=device)
    load_lora_base(model, cfg)
    load_model_weights(checkpoint, model)
    return merge_adapters(model) if merge else model


@torch.no_grad()
def load_lora_base(model, cfg: Config) -> None:
    """The frozen base a LoRA run trained beside: what its config.json's train.init_from names, or
    (empty) the seeded initial weights of train.seed."""
    if not cfg.train.init_from:
        model.init_weights(cfg.train.seed)
        return
    from shardwise.checkpoint.init_from import pretrained_state_dict

    missing, unexpected = model.load_state_dict(pretrained_state_dict(cfg.train.init_from, cfg.model), strict=False)
    missing = [name for name in missing if not is_adapter_name(name)]
    if missing or unexpected:
        raise ValueError(f"train.init_from = {cfg.train.init_from!r} does not hold the base this LoRA run trained "
                         f"on (missing {missing[:3]}, unexpected {unexpected[:3]}); restore the base it names")


def open_engine(run_dir: Path, *, device_name: str = "auto", checkpoint: Path | None = None, max_batch: int = 16,
                prefill_chunk: int = 256, context_len: int | None = None, compile: bool = False,
                prefix_cache_mb: int | None = None, quantize: str | None = None, group_size: int | None = None,
                speculate: str | None = None, num_speculative_tokens: int | None = None):
    """(config, engine, tokenizer) of a trained run, on every rank of the launch; `prefix_cache_mb`
    (`generation.prefix_cache.prefix_cache_bytes`: None is the default, 0 off) bounds each rank's
    prefix cache; with `quantize` ("int8", "int4"), its linears quantized at load
    (`generation/quantize.py`).

    With several ranks the model is tensor-parallel over all of them; rank 0's engine leads and
    the others must call `engine.runner.follow()` (they serve its steps until it stops).
    `speculate` ("ngram" or "draft:RUN") turns on speculative decoding (`generation/speculation.py`)."""
    from shardwise.data.spelled_specials import EncoderInputTokenizer
    from shardwise.data.tokenizer import eos_id
    from shardwise.distributed.dims import ParallelDims
    from shardwise.runtime.process_group import init_distributed
    from shardwise.generation.engine import Engine, speculator_for
    from shardwise.generation.prefix_cache import enable_prefix_caching, prefix_cache_bytes
    from shardwise.generation.runner import runner_for
    from shardwise.generation.speculation_options import speculation_options
    from shardwise.infer.draft_run import check_draft_run

    speculation = speculation_options(speculate, num_speculative_tokens)
    run_cfg = read_run_config(Path(run_dir))
    model_cfg = run_cfg.model
    check_quantize_flag(quantize, group_size, run_cfg, run_dir)
    check_context_len(context_len, model_cfg)
    check_draft_run(speculation, Path(run_dir), model_cfg, context_len or model_cfg.max_seq_len)
    spec = spec_of(model_cfg.family)
    if not spec.generates_text:
        raise ValueError(f"--run {str(run_dir)!r} is a {spec.name} model, which does not generate text; "
                         f"`shardwise predict --run {run_dir}` runs it")
    device, _, world_size = init_distributed(device_name)
    prefix_bytes = prefix_cache_bytes(prefix_cache_mb, model_cfg, encoder_decoder=spec.encoder_decoder,
                                      num_shards=world_size)
    check_cache_fits(model_cfg, max_batch, context_len or model_cfg.max_seq_len, device, world_size, prefix_bytes)
    tp_mesh = None
    if world_size > 1:  # the model split over every process, tensor-parallel
        tp_mesh = ParallelDims(world_size=world_size, tp=world_size).build_meshes(device.type).world["tp"]
    cfg, model, tokenizer = load_run(Path(run_dir), device=device, tp_mesh=tp_mesh, checkpoint=checkpoint)
    if quantize:
        from shardwise.generation.quantize import quantize_model

        quantize_model(model, quantize, group_size)
    sizes = dict(num_slots=max_batch, capacity=context_len, compile=compile, owns_model=True)
    runner = runner_for(model, group=None if tp_mesh is None else tp_mesh.get_group(), **sizes)
    if spec.encoder_decoder:  # prompts are the encoder's input: sentinels as typed, ended by end-of-text
        tokenizer = EncoderInputTokenizer(tokenizer, eos_id(tokenizer))
    prefix_cache = enable_prefix_caching(runner, prefix_bytes) if prefix_bytes else None
    leader = tp_mesh is None or tp_mesh.get_local_rank() == 0  # only the leader's engine steps
    draft = None
    if speculation is not None and speculation.draft_run is not None:
        # Its checkpoint is chosen on every rank (the integrity check is collective), its model loaded by the
        # leader alone: under tensor parallelism a leader checking alone waited forever on the other ranks.
        draft_checkpoint = newest_valid_checkpoint(Path(speculation.draft_run))
        if draft_checkpoint is None:
            raise ValueError(f"--speculate = 'draft:{speculation.draft_run}' is invalid: none of its checkpoints is "
                             "whole (the lines above say why); train it again or restore one")
        if leader:
            draft = load_run(speculation.draft_run, device=device, checkpoint=draft_checkpoint)[1]
    speculator = speculator_for(runner, speculation, draft, compile=compile, owns_model=True) if leader else None
    engine = Engine(runner, tokenizer, eos_id=eos_id(tokenizer), prefill_chunk=prefill_chunk,
                    prefix_cache=prefix_cache, speculator=speculator)
    return cfg, engine, tokenizer


def check_context_len(context_len: int | None, model_cfg) -> None:
    """--context-len within what the model was built for (its positions end at max_seq_len)."""
    if context_len is None:
        return
    if context_len < 2:
        raise ValueError(f"--context-len = {context_len} is invalid: use at least 2 tokens (or leave it out for "
                         "the model's max_seq_len)")
    if context_len > model_cfg.max_seq_len:
        raise ValueError(f"--context-len = {context_len} is invalid: the model's max_seq_len is "
                         f"{model_cfg.max_seq_len}; use at most that (or leave it out)")


def check_cache_fits(model_cfg, max_batch: int, context_len: int, device, world_size: int,
                     prefix_bytes: int = 0) -> None:
    """--max-batch slots of --context-len tokens, and beside them the prefix cache's pool of
    `prefix_bytes`, must fit the device's free memory: both fill up while requests are served, where
    running out would fail every request instead of the start."""
    from shardwise.generation.runner import free_memory_bytes, kv_cache_bytes

    need = kv_cache_bytes(model_cfg, num_slots=max_batch, capacity=context_len, num_shards=world_size)
    free = free_memory_bytes(device)
    if free is None:
        return
    if need > free:
        raise ValueError(f"--max-batch = {max_batch} is invalid: {max_batch} slots of {context_len} tokens need "
                         f"{need / 2**30:.1f} GiB of KV cache, more than the {free / 2**30:.1f} GiB free on "
                         f"{device.type}; lower --max-batch (or --context-len)")
    if need + prefix_bytes > free:
        raise ValueError(f"--prefix-cache-mb = {prefix_bytes // 2**20} is invalid: its pool beside the KV cache "
                         f"({need / 2**30:.1f} GiB) needs more than the {free / 2**30:.1f} GiB free on {device.type}; "
                         "lower --prefix-cache-mb (0: off) or --max-batch")


def check_quantize_flag(quantize: str | None, group_size: int | None, cfg: Config, run_dir) -> None:
    """--quantize: a scheme, on a run whose weights are float; --group-size only with int4."""
    from shardwise.generation.quantize import check_scheme

    if group_size is not None and quantize != "int4":
        raise ValueError(f"--group-size = {group_size} is invalid without --quantize int4: only int4 groups its "
                         "scales; add --quantize int4 or leave --group-size out")
    if not quantize:
        return
    check_scheme(quantize, "--quantize")
    if cfg.checkpoint.quantization:
        raise ValueError(f"--quantize = {quantize} is invalid: --run {str(run_dir)!r} is already quantized "
                         f"({cfg.checkpoint.quantization}, by `shardwise quantize`); serve it without --quantize")
