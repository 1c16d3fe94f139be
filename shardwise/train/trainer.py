"""The training loop of one process: data → model → loss → AdamW, with gradient accumulation,
clipping, the LR schedule, per-step metrics, checkpoints, and a closing sample.

The run directory holds everything needed to resume or to generate: `config.json`,
`tokenizer.json`, `run.json` (device, parameter count, where the FLOP peak comes from),
`metrics.jsonl` and `checkpoints/`.
"""

from __future__ import annotations

import base64
import contextlib
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from shardwise.config.schema import Config
from shardwise.config.errors import invalid
from shardwise.data.loader import TokenLoader
from shardwise.data.prepare import build_dataset
from shardwise.data.tokenizer import eos_id
from shardwise.infer.generate import generate
from shardwise.distributed.data_parallel import DataParallel, build_data_parallel
from shardwise.distributed.dims import ParallelDims, backend_for
from shardwise.distributed.expert_parallel import collect_moe_stats, update_router_biases
from shardwise.distributed.pipeline_parallel import parts_of
from shardwise.models.common.moe import set_aux_loss_scale
from shardwise.models.llama.model import Llama
from shardwise.observe.comm_log import CommLog
from shardwise.observe.pipeline_timeline import TimelineWriter
from shardwise.observe.memory import format_memory_report, state_memory, zero_formula_bytes
from shardwise.planner.auto import resolve_parallel
from shardwise.train.checkpoint import (
    checkpoint_tensor_shapes,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    write_json_atomic,
)
from shardwise.train.metrics import MetricsWriter, peak_flops, peak_memory_gib
from shardwise.train.optim import lr_at, set_lr
from shardwise.train.progress import StepReporter


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)
    """Loss of each step run in this call (a resumed run starts after its checkpoint)."""
    first_step: int = 1
    micro_batches_per_step: int = 0
    """Micro-batches this rank ran per step: global batch / (micro-batch x data-parallel ranks)."""
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


def forward_backward(dp: DataParallel, micro_batches, cfg: Config, device) -> float:
    """Gradients of the mean loss over the accumulated micro-batches; returns this rank's mean
    loss. Each micro-batch holds the same number of tokens, so the mean of means is the mean
    over the rank's share of the global batch."""
    total = torch.zeros((), device=device)
    count = len(micro_batches)
    set_aux_loss_scale(dp.model, 1 / count)  # MoE aux losses are scaled as the loss is
    for index, (inputs, targets) in enumerate(micro_batches):
        with dp.micro_batch(index, count), dp.loss_context():
            loss = loss_of(dp.module, inputs.to(device), targets.to(device), cfg, device) / count
            loss.backward()
        dp.after_backward()
        detached = loss.detach()
        total += detached.full_tensor() if isinstance(detached, DTensor) else detached
    return float(total)


def pipeline_forward_backward(dp: DataParallel, micro_batches, cfg: Config, device) -> float:
    """The same through the pipeline schedule, which runs all micro-batches itself. For the
    data-parallel strategy the whole schedule is one micro-batch that is not the last
    (gradients accumulate locally), and an empty last one then reduces them once."""
    set_aux_loss_scale(dp.model, 1.0)  # the schedule divides all gradients by the micro-batches itself
    with dp.micro_batch(0, 2), dp.loss_context(), autocast_context(device, cfg.train.autocast_dtype):
        loss = dp.pipeline.step(micro_batches, device)
    with dp.micro_batch(1, 2):
        dp.after_backward()
    dp.pipeline.finish_gradients()
    return loss


def train_step(dp: DataParallel, micro_batches, cfg: Config, device) -> tuple[float, float]:
    """One optimizer step over the accumulated micro-batches: (this rank's mean loss, global grad
    norm before clipping)."""
    if dp.context is not None:
        micro_batches = dp.context.split_batches(micro_batches)
    run = forward_backward if dp.pipeline is None else pipeline_forward_backward
    loss = run(dp, micro_batches, cfg, device)
    max_norm = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
    grad_norm = dp.clip_grad_norm(max_norm)
    dp.step()
    return loss, grad_norm


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


def init_distributed(cfg: Config) -> tuple[torch.device, int, int]:
    """(device, rank, world size). Under a launcher (WORLD_SIZE > 1 in the environment) this
    joins the process group, unless the caller already created one (the test harness does)."""
    device = resolve_device(cfg.train.device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and device.type != "cpu":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device(device.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend_for(device))
    if dist.is_initialized():
        return device, dist.get_rank(), dist.get_world_size()
    return device, 0, 1


def barrier(dims: ParallelDims) -> None:
    if dims.is_distributed:
        dist.barrier()


def build_dataset_once(cfg: Config, is_main: bool, dims: ParallelDims):
    """Rank 0 trains the tokenizer and tokenizes; the others then find it in the cache."""
    dataset = build_dataset(cfg.data) if is_main else None
    barrier(dims)
    return dataset or build_dataset(cfg.data)


def resume(run_dir: Path, dp: DataParallel, loader: TokenLoader) -> tuple[int, Path | None]:
    """Restore model, optimizer and data position from the newest checkpoint: (steps done, path)."""
    found = latest_checkpoint(run_dir)
    if found is None:
        return 0, None
    tensors = dp.checkpoint_tensors()
    saved = checkpoint_tensor_shapes(found)
    if not any(key.startswith("optim/") for key in saved):
        # An imported checkpoint (`shardwise convert --from-hf`): weights only, a fresh optimizer.
        tensors = {key: value for key, value in tensors.items() if key.startswith("model/")}
    state = load_checkpoint(found, tensors=tensors)
    if state.get("loader"):
        loader.load_state_dict(state["loader"])
    if state.get("rng"):
        restore_rng(state["rng"])
    return state["step"], found


def rng_state() -> dict:
    """The torch RNG state, JSON-friendly. Training itself draws no random numbers (no dropout),
    but anything added later that does (and the closing sample) continues as it would have."""
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def restore_rng(state: dict) -> None:
    def as_tensor(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(as_tensor(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(as_tensor(state["cuda"]))


def pipeline_timeline_writer(dp: DataParallel, cfg: Config, run_dir: Path, rank: int) -> TimelineWriter | None:
    if dp.pipeline is None:
        return None
    header = {"schedule": cfg.parallel.pp_schedule, "pp": dp.dims.pp, "virtual_stages": cfg.parallel.pp_virtual_stages,
              "micro_batches": dp.dims.num_micro_batches(cfg), "pp_rank": dp.pipeline.rank,
              "defined_order": dp.pipeline.defined_order()}
    return TimelineWriter(run_dir, rank, header)


def gather_full_state(dp: DataParallel, is_main: bool) -> dict[str, torch.Tensor] | None:
    """The whole model's tensors on rank 0 (None elsewhere), from any layout: DTensors (ZeRO-3,
    tensor parallel) are gathered by DCP, pipeline stages sent to rank 0 by one rank of each."""
    pp = dp.dims.pp
    full = {}
    for part in parts_of(dp.model):
        # Rank 0 alone gets the tensors with cpu_offload, so pipeline stages elsewhere need them all.
        full.update(get_model_state_dict(part, options=StateDictOptions(full_state_dict=True, cpu_offload=pp == 1)))
    if pp > 1:
        mesh = dp.mesh
        sends = dp.dims.dp_rank(mesh) == 0 and mesh["tp"].get_local_rank() == 0 and mesh["cp"].get_local_rank() == 0
        mine = {name: t.detach().cpu() for name, t in full.items()} if sends else {}
        gathered = [None] * dp.dims.world_size if is_main else None
        dist.gather_object(mine, gathered, dst=0)
        full = {name: t for part in gathered for name, t in part.items()} if is_main else None
    return full if is_main else None


def sampling_model(dp: DataParallel, is_main: bool):
    """A plain, full model on rank 0 for the closing sample (None elsewhere). ZeRO-3, tensor and
    pipeline parallelism split parameters, so they are gathered first — collectives every rank joins;
    context parallelism replaced the attention, so rank 0 copies the weights into a plain model."""
    # Context parallelism changed the model's attention and positions: sample from a plain copy.
    plain = dp.dims.pp == 1 and dp.dims.cp == 1
    if plain and not any(isinstance(p, DTensor) for p in dp.model.parameters()):
        return dp.model if is_main else None
    full = gather_full_state(dp, is_main)
    if not is_main:
        return None
    with torch.device("meta"):
        model = Llama(dp.cfg.model)
    model.to_empty(device="cpu")
    model.load_state_dict(full)
    return model


def closing_sample(dp: DataParallel, tokenizer, cfg: Config, is_main: bool) -> str:
    """Text generated by the trained model from train.sample_prompt (empty on other ranks)."""
    model = sampling_model(dp, is_main)
    if model is None:
        return ""
    model.eval()
    prompt = tokenizer.encode(cfg.train.sample_prompt).ids
    new_ids = generate(model, prompt, max_new_tokens=cfg.train.sample_tokens, eos_id=eos_id(tokenizer),
                       temperature=cfg.train.sample_temperature, top_k=cfg.train.sample_top_k, seed=cfg.train.seed)
    return cfg.train.sample_prompt + tokenizer.decode(new_ids)


def train(cfg: Config, *, console=None) -> TrainResult:
    started = time.perf_counter()
    device, rank, world_size = init_distributed(cfg)
    cfg = resolve_parallel(cfg, world_size, device_type=device.type)  # parallel.mode = "auto": the planner's layout
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    dims.check(cfg)
    is_main = rank == 0
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    mesh = dims.build_mesh(device.type)
    dataset = build_dataset_once(cfg, is_main, dims)
    check_data_fits_model(cfg, dataset.tokens.meta)
    loader = TokenLoader(
        dataset.tokens, seq_len=cfg.train.seq_len, global_batch_size=cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, vocab_size=cfg.model.vocab_size,
        dp_rank=dims.dp_rank(mesh), dp_size=dims.dp,
    )
    run_dir = Path(cfg.run.dir)
    if is_main:
        prepare_run_dir(cfg, dataset.tokenizer_path)
    barrier(dims)
    torch.manual_seed(cfg.train.seed)
    dp = build_data_parallel(cfg, dims, mesh, device)
    done, checkpoint = resume(run_dir, dp, loader) if cfg.checkpoint.resume else (0, None)

    dtype = getattr(torch, cfg.train.autocast_dtype)
    peak = peak_flops(device, dtype)
    flops_per_token = cfg.model.flops_per_token(cfg.train.seq_len)
    tokens_per_step = cfg.train.global_batch_size * cfg.train.seq_len
    _, memory_kind = peak_memory_gib(device)
    last_step = min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps)
    result = TrainResult(run_dir=run_dir, first_step=done + 1, micro_batches_per_step=loader.num_micro_batches)
    metrics = reporter = None
    if is_main:
        write_json_atomic(run_dir / "run.json", {
            "device": str(device), "world_size": world_size, "layout": dims.describe(),
            "num_params": cfg.model.num_params(), "num_active_params": cfg.model.num_active_params(),
            "flops_per_token": flops_per_token,
            "peak_flops_per_device": peak.flops_per_s, "peak_flops_source": peak.source,
            "peak_memory_measures": memory_kind, "tokens_per_step": tokens_per_step,
            "resumed_from": str(checkpoint) if checkpoint else None,
        })
        metrics = MetricsWriter(run_dir / "metrics.jsonl", resume_from_step=done)
        reporter = StepReporter(cfg, first_step=done + 1, last_step=last_step, console=console, layout=dims.describe())
    dp.module.train()
    # Functional collectives (DTensor) cost a dispatch hook per op: count them only when used.
    comm_log = CommLog(functional_collectives=dims.tp > 1)
    timeline = pipeline_timeline_writer(dp, cfg, run_dir, rank)
    try:
        for step in range(done + 1, last_step + 1):
            step_start = time.perf_counter()
            lr = lr_at(step - 1, cfg.train)
            set_lr(dp.optimizer, lr)
            with comm_log:
                comm_log.reset()
                local_loss, grad_norm = train_step(dp, loader.next_step(), cfg, device)
            comm = comm_log.summary(by="kind")
            if timeline is not None:
                timeline.write(step, dp.pipeline.events())
            lm_loss = loss = dp.mean_over_dp(local_loss)
            moe = collect_moe_stats(dp.model, cfg.model, tp=dims.tp, distributed=dims.is_distributed)
            if moe is not None:  # the loss optimised includes the routers' auxiliary losses
                loss += moe.aux_loss + moe.z_loss
                update_router_biases(dp.model, cfg.model, moe)
            # Measured after the optimizer step and before zero_grad: every kind of state exists.
            memory_bytes = state_memory(dp.model, dp.optimizer, extra_grads=dp.grad_tensors())
            dp.zero_grad()
            if device.type != "cpu":
                torch.accelerator.synchronize()
            step_time = time.perf_counter() - step_start
            tokens_per_s = tokens_per_step / step_time
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {step}; lower train.lr or enable train.grad_clip")
            result.losses.append(loss)
            if is_main:
                record = {
                    "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time,
                    "tokens_per_s": tokens_per_s,
                    "mfu": flops_per_token * tokens_per_s / (peak.flops_per_s * world_size),
                    "peak_memory_gib": peak_memory_gib(device)[0], "tokens_seen": step * tokens_per_step,
                    **{f"{kind}_bytes": value for kind, value in memory_bytes.items()},
                    "comm": comm,
                    **({"lm_loss": lm_loss, **moe.metrics()} if moe is not None else {}),
                }
                metrics.write(record)
                if step == done + 1:
                    # The ZeRO formula covers data parallelism; with tp the norms stay replicated,
                    # pipeline stages hold unequal parts, and ep shards the experts otherwise: no formula.
                    formula = None if dims.tp > 1 or dims.pp > 1 or dims.ep > 1 else zero_formula_bytes(
                        cfg.model.num_params(), dims.zero if dims.is_distributed else 0, dims.dp * dims.cp)
                    reporter.show_memory(format_memory_report(memory_bytes, formula), dims.describe())
                reporter.update(record)
            is_last = step == last_step
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or (is_last and cfg.checkpoint.at_end):
                save_checkpoint(run_dir, step, tensors=dp.checkpoint_tensors(), keep=cfg.checkpoint.keep,
                                state={"loader": loader.state_dict(), "layout": dims.describe(), "rng": rng_state()})
    finally:
        if is_main:
            metrics.close()
            reporter.close()

    if cfg.train.sample_tokens:
        result.sample = closing_sample(dp, dataset.tokenizer, cfg, is_main)
        if is_main:
            reporter.show_sample(result.sample)
        barrier(dims)
    result.wall_time_s = time.perf_counter() - started
    return result
