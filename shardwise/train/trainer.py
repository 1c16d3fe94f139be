"""The training loop of one process: data → model → loss → AdamW, with gradient accumulation,
clipping, the LR schedule, per-step metrics, checkpoints, and a closing sample.

The run directory holds everything needed to resume or to generate: `config.json`,
`tokenizer.json`, `run.json` (device, parameter count, where the FLOP peak comes from),
`metrics.jsonl` and `checkpoints/`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.config.schema import Config, invalid
from shardwise.data.loader import TokenLoader
from shardwise.data.prepare import build_dataset
from shardwise.data.tokenizer import eos_id
from shardwise.infer.generate import generate
from shardwise.models.llama.model import build_model
from shardwise.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, write_json_atomic
from shardwise.train.metrics import MetricsWriter, peak_flops, peak_memory_gib
from shardwise.train.optim import build_optimizer, lr_at, set_lr
from shardwise.train.progress import StepReporter


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    """Loss of each step run in this call (a resumed run starts after its checkpoint)."""
    first_step: int = 1
    sample: str = ""
    wall_time_s: float = 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return accel if accel is not None else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise invalid("train.device", name, "use auto, cpu, cuda, cuda:N or another torch device name") from None
    if device.type != "cpu" and not torch.accelerator.is_available():
        raise invalid("train.device", name, "no accelerator is available here; use cpu or auto")
    return device


def autocast_context(device: torch.device, dtype_name: str):
    if dtype_name == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype_name))


def loss_of(model, inputs, targets, cfg: Config, device) -> torch.Tensor:
    with autocast_context(device, cfg.train.autocast_dtype):
        logits = model(inputs)
    # Cross-entropy in fp32 whatever the compute dtype: a bf16 log-softmax over a large
    # vocabulary loses the small probabilities that carry the gradient.
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train_step(model, optimizer, micro_batches, cfg: Config, device) -> tuple[float, float]:
    """One optimizer step over the accumulated micro-batches: (mean loss, grad norm before clipping).
    Each micro-batch holds the same number of tokens, so the mean of means is the global mean."""
    total = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        loss = loss_of(model, inputs.to(device), targets.to(device), cfg, device) / len(micro_batches)
        loss.backward()
        total += loss.detach()
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total), float(grad_norm)


def prepare_run_dir(cfg: Config, tokenizer_path: Path) -> Path:
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(run_dir / "config.json", cfg.to_dict())
    tmp = run_dir / ".tokenizer.json.tmp"
    shutil.copyfile(tokenizer_path, tmp)
    os.replace(tmp, run_dir / "tokenizer.json")
    return run_dir


def check_data_fits_model(cfg: Config, tokens_meta: dict) -> None:
    if tokens_meta["vocab_size"] > cfg.model.vocab_size:
        raise invalid(
            "model.vocab_size", cfg.model.vocab_size,
            f"the tokenizer has {tokens_meta['vocab_size']} tokens; use model.vocab_size >= {tokens_meta['vocab_size']}",
        )


def train(cfg: Config, *, console=None) -> TrainResult:
    started = time.perf_counter()
    device = resolve_device(cfg.train.device)
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    dataset = build_dataset(cfg.data)
    check_data_fits_model(cfg, dataset.tokens.meta)
    loader = TokenLoader(
        dataset.tokens, seq_len=cfg.train.seq_len, global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, vocab_size=cfg.model.vocab_size,
    )
    run_dir = prepare_run_dir(cfg, dataset.tokenizer_path)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    optimizer = build_optimizer(model, cfg.train)

    done = 0
    checkpoint = latest_checkpoint(run_dir) if cfg.checkpoint.resume else None
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model=model, optimizer=optimizer, device=device)
        if state.get("loader"):  # absent in a checkpoint imported by `shardwise convert`
            loader.load_state_dict(state["loader"])
        done = state["step"]

    dtype = getattr(torch, cfg.train.autocast_dtype)
    peak = peak_flops(device, dtype)
    flops_per_token = cfg.model.flops_per_token(cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    _, memory_kind = peak_memory_gib(device)
    write_json_atomic(run_dir / "run.json", {
        "device": str(device), "num_params": cfg.model.num_params(), "flops_per_token": flops_per_token,
        "peak_flops": peak.flops_per_s, "peak_flops_source": peak.source, "peak_memory_measures": memory_kind,
        "tokens_per_step": tokens_per_step, "resumed_from": str(checkpoint) if checkpoint else None,
    })

    result = TrainResult(run_dir=run_dir, first_step=done + 1)
    last_step = min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps)
    metrics = MetricsWriter(run_dir / "metrics.jsonl", resume_from_step=done)
    reporter = StepReporter(cfg, first_step=done + 1, last_step=last_step, console=console)
    model.train()
    try:
        for step in range(done + 1, last_step + 1):
            step_start = time.perf_counter()
            lr = lr_at(step - 1, cfg.train)
            set_lr(optimizer, lr)
            loss, grad_norm = train_step(model, optimizer, loader.next_step(), cfg, device)
            if device.type != "cpu":
                torch.accelerator.synchronize()
            step_time = time.perf_counter() - step_start
            tokens_per_s = tokens_per_step / step_time
            memory, _ = peak_memory_gib(device)
            record = {
                "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time,
                "tokens_per_s": tokens_per_s, "mfu": flops_per_token * tokens_per_s / peak.flops_per_s,
                "peak_memory_gib": memory, "tokens_seen": step * tokens_per_step,
            }
            metrics.write(record)
            reporter.update(record)
            result.losses.append(loss)
            if not torch.isfinite(torch.tensor(loss)):
                raise FloatingPointError(f"loss became {loss} at step {step}; lower train.lr or enable train.grad_clip")
            is_last = step == last_step
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or (is_last and cfg.checkpoint.at_end):
                save_checkpoint(run_dir, step, model=model, optimizer=optimizer, keep=cfg.checkpoint.keep,
                                state={"loader": loader.state_dict()})
    finally:
        metrics.close()
        reporter.close()

    if cfg.train.sample_tokens:
        model.eval()
        tokenizer = dataset.tokenizer
        prompt = tokenizer.encode(cfg.train.sample_prompt).ids
        new_ids = generate(model, prompt, max_new_tokens=cfg.train.sample_tokens, eos_id=eos_id(tokenizer),
                           temperature=cfg.train.sample_temperature, top_k=cfg.train.sample_top_k, seed=cfg.train.seed)
        result.sample = cfg.train.sample_prompt + tokenizer.decode(new_ids)
        reporter.show_sample(result.sample)
    result.wall_time_s = time.perf_counter() - started
    return result
