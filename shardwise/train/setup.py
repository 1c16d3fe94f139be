"""Setting up a training run, before its first step: in the run context (train/context.py: the
process group, device and what watches the process), the layout (`parallel.mode = "auto"`
resolved, degrees checked, meshes built), the data, the run directory, then the model laid out by
`parallelize` and its optimizer."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.compile.float8 import check_float8_device
from shardwise.config.schema import Config
from shardwise.data.chat_template import save_chat_template
from shardwise.data.loader import TokenLoader
from shardwise.data.training_data import build_run_loaders, prepare_data
from shardwise.distributed.dims import Meshes, ParallelDims
from shardwise.distributed.parallelize import ParallelModel, parallelize_config
from shardwise.runtime.process_group import barrier
from shardwise.train.auto_layout import resolve_parallel
from shardwise.checkpoint.init_from import load_pretrained
from shardwise.checkpoint.store import checkpoint_dirs, write_json_atomic
from shardwise.train.context import RunContext
from shardwise.train.optim import build_optimizer
from shardwise.train.run_directory import check_starting_over, take_run_dir
from shardwise.train.preflight import (check_checkpoint_fits_data, check_checkpoint_fits_model,
                                      check_data_fits_model, check_run_dir)


@dataclass
class Run:
    """What one process of a run knows before its first step."""

    cfg: Config
    context: RunContext
    dims: ParallelDims
    meshes: Meshes
    dataset: object
    loader: TokenLoader
    val_loader: TokenLoader | None = None
    """The validation split's batches (data.val_fraction > 0)."""

    @property
    def device(self) -> torch.device:
        return self.context.device

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def dir(self) -> Path:
        return self.context.run_dir

    @property
    def is_main(self) -> bool:
        return self.context.is_main


def set_up(cfg: Config, context: RunContext) -> Run:
    """Everything but the model; every check runs before any work (or any file) is done."""
    rank, world_size = context.rank, context.world_size
    if cfg.checkpoint.quantization:  # codes, not weights: `shardwise quantize` wrote the run for serving
        raise ValueError(f"checkpoint.quantization = {cfg.checkpoint.quantization!r} is invalid for training: the "
                         "run's weights are quantized for serving; train the float run it came from")
    # parallel.mode = "auto": the planner's layout
    cfg = resolve_parallel(cfg, world_size, device_type=context.device.type, announce=context.is_main)
    cfg.validate_float8()  # against the layout the planner chose too
    check_float8_device(cfg.train.float8, context.device)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    dims.check(cfg)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    meshes = dims.build_meshes(context.device.type, tied_embeddings=cfg.model.tie_embeddings)
    if rank == 0:
        check_run_dir(cfg)  # writable, and its metrics.jsonl readable: before the data or any file is made
    # Rank 0 trains the tokenizer and tokenizes; the others then find it in the cache. A one-process
    # run hashes a cached token file; ranks check it is as last hashed (by the launcher, moments ago).
    dataset = prepare_data(cfg, verify=world_size == 1) if rank == 0 else None
    barrier(world_size)
    dataset = dataset or prepare_data(cfg, verify=False)
    check_data_fits_model(cfg, dataset)
    loader, val_loader = build_run_loaders(cfg, dataset, dp_rank=dims.dp_rank(meshes), dp_size=dims.dp)
    if rank == 0:
        if cfg.checkpoint.resume:  # before prepare_run_dir rewrites the run's config.json
            check_checkpoint_fits_model(cfg)
            check_checkpoint_fits_data(cfg, loader)
        check_starting_over(cfg)  # resume = false beside another run's checkpoints
        take_run_dir(cfg, context.run_lock)
        prepare_run_dir(cfg, getattr(dataset, "tokenizer_path", None), getattr(dataset, "chat_template", None))
    barrier(world_size)
    return Run(cfg=cfg, context=context, dims=dims, meshes=meshes, dataset=dataset, loader=loader,
               val_loader=val_loader)


def build(run: Run) -> tuple[ParallelModel, torch.optim.Optimizer]:
    """The model laid out over the run's ranks (holding train.init_from's weights, unless its own
    checkpoints hold them), and AdamW over what this rank updates."""
    pm = parallelize_config(run.cfg, run.dims, device=run.device, meshes=run.meshes)
    if run.cfg.train.init_from and not resumes_own_weights(run.cfg):
        load_pretrained(pm, run.cfg)
    optimizer = build_optimizer([param for _, param, _ in pm.sync.named_optimizer_params()], run.cfg.train)
    return pm, optimizer


def resumes_own_weights(cfg: Config) -> bool:
    """The run will resume one of its own checkpoints (`store.resume`), and they hold its weights: a LoRA
    run's hold only the adapters, so its base is read from train.init_from on every start."""
    return cfg.checkpoint.resume and not cfg.train.lora_rank and bool(checkpoint_dirs(Path(cfg.run.dir)))


def prepare_run_dir(cfg: Config, tokenizer_path: Path | None, chat_template=None) -> Path:
    """The run directory with its config.json, (text) tokenizer.json and, where the training rows were
    rendered with one, the chat template as tokenizer_config.json: `shardwise serve --run` renders alike."""
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", cfg.to_dict())
    if tokenizer_path is None:  # an image model has no tokenizer
        return run_dir
    tmp = run_dir / ".tokenizer.json.tmp"
    shutil.copyfile(tokenizer_path, tmp)
    os.replace(tmp, run_dir / "tokenizer.json")
    if chat_template is not None:
        save_chat_template(run_dir, chat_template)
    return run_dir
