"""One small Config dataclass per component, and the top-level `Config` that holds them.

Each field's docstring (the string literal under it) is its `--help` text; `fields.py`
reads them from the source. Every `validate()` raises `ValueError` naming the field, the
value and the fix, so bad input stops before any work starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import signal
import typing
from dataclasses import dataclass, field

from shardwise.core.errors import invalid, require_positive, require_representable
from shardwise.core.layout_rules import (
    CONFIG_NAMES,
    CP_MODES,
    PP_SCHEDULES,
    RECOMPUTE_MODES,
    ZERO_STAGES,
    parallel_violations,
)
from shardwise.core.model import ModelConfig
from shardwise.config.presets import PRESETS
from shardwise.models.families import SPECS, spec_of, validate_model
from shardwise.core.units import DEFAULT_BUCKET_MB


@dataclass(kw_only=True)
class DataConfig:
    source: str = "stdlib"
    """Training text: "stdlib" (the demo corpus: this Python's standard-library sources), or a
    comma-separated list of .txt/.py/.md/.jsonl/.parquet files or directories; for model.family vit,
    images: "digits" (scikit-learn's bundled 8x8 handwritten digits)."""
    tokenizer: str = ""
    """Path to a HF `tokenizers` tokenizer.json; empty trains a byte-level BPE on the source (cached)."""
    vocab_size: int = 4096
    """Vocabulary size of a tokenizer trained here (must not exceed model.vocab_size)."""
    max_corpus_bytes: int = 4_000_000
    """Cap on the text read for the corpus (keeps the demo's data step to seconds); 0 = no cap."""
    text_field: str = "text"
    """Field/column holding the text in .jsonl and .parquet sources."""
    cache_dir: str = ""
    """Where tokenizers and token files are cached; empty = $SHARDWISE_CACHE or ~/.cache/shardwise."""
    val_fraction: float = 0.0
    """Hold out this fraction of the tokens (the end of the token stream) as the validation split, never
    trained on; the same split at every layout and on resume. 0 = train on everything, no evaluation."""
    image_pad: int = 0
    """Image data: background pixels added on each side of every image (e.g. 1 turns the 8x8 digits into
    10x10, 25 patches of 2x2: with the class token a sequence of 26 that splits over 2 ranks)."""
    mask_fraction: float = 0.15
    """Masked LM (model.family bert): the fraction of each sequence's tokens the model predicts, exactly
    round(fraction x seq_len) per sequence; of those 80% are masked, 10% replaced, 10% kept (BERT)."""
    length_multiple: int = 1
    """Span corruption (model.family t5): make the encoder input's length (seq_len - 2n + 1 for n spans)
    and the targets' (4n + 1) multiples of this: the input drops the window's last few tokens, the targets
    end with ignored positions. Sequence parallelism splits both over the tp ranks: set it to parallel.tp."""

    format: str = "text"
    """What the source holds: "text" (a token stream, pretraining); "chat" (JSONL/Parquet rows with `messages`,
    OpenAI roles system/user/assistant, rendered with the chat template); "prompt_completion" (rows with
    `prompt` and `completion`; with data.source "stdlib": each standard-library function's signature and
    docstring -> its body); "preference" (rows with `prompt`, `chosen`, `rejected`, strings or messages:
    train.objective = "dpo")."""
    loss_on: str = ""
    """Which tokens carry the loss: "assistant" (every assistant turn, its end-of-turn token included: the
    chat default), "completion" (the completion and its end token: the prompt_completion default) or "all";
    empty = the format's default ("all" for text)."""
    chat_template: str = ""
    """The chat template (jinja2) that renders chat rows, as text or a path to a .jinja file; empty = the
    template of train.init_from's tokenizer_config.json, else the run's, else a plain built-in one."""
    packing: bool = False
    """Pack several examples into each train.seq_len window (chat and prompt_completion): each token attends
    only within its own example and positions restart per example, so no compute is spent on padding.
    false: one example per sequence, padded to train.seq_len."""
    document_mask: bool = False
    """Text: each token attends only within its own document of the stream (documents end with the
    end-of-text token), positions restarting per document, as Llama 3 pretrains."""
    overlong: str = "truncate"
    """An example longer than train.seq_len: "truncate" (keep its first train.seq_len tokens), "drop" (leave
    it out) or "error" (stop, naming the row); the counts are in the log."""

    def validate(self) -> None:
        if not self.source.strip():
            raise invalid("data.source", self.source, 'name text files/directories, or "stdlib" for the demo corpus')
        if self.format not in DATA_FORMATS:
            raise invalid("data.format", self.format, f"use one of {', '.join(DATA_FORMATS)}")
        allowed = LOSS_ON_BY_FORMAT[self.format]
        if self.loss_on and self.loss_on not in allowed:
            raise invalid("data.loss_on", self.loss_on, f"data.format {self.format} takes one of "
                                                        f"{', '.join(allowed)} (or empty for {allowed[0]})")
        if self.overlong not in OVERLONG_ACTIONS:
            raise invalid("data.overlong", self.overlong, f"use one of {', '.join(OVERLONG_ACTIONS)}")
        if self.packing and self.format not in ("chat", "prompt_completion"):
            raise invalid("data.packing", self.packing, f"it packs chat or prompt_completion examples, and "
                                                        f"data.format is {self.format}; for a text stream use "
                                                        "data.document_mask")
        if self.document_mask and self.format != "text":
            raise invalid("data.document_mask", self.document_mask, f"it masks the documents of a text stream, "
                                                                    f"and data.format is {self.format}; use data.packing")
        require_positive("data", self, "vocab_size")
        if self.vocab_size < 260:
            raise invalid("data.vocab_size", self.vocab_size, "use at least 260 (256 bytes + special tokens)")
        if self.max_corpus_bytes < 0:
            raise invalid("data.max_corpus_bytes", self.max_corpus_bytes, "use 0 (no cap) or a positive byte count")
        if not 0.0 <= self.val_fraction < 1.0:
            raise invalid("data.val_fraction", self.val_fraction, "use a fraction in [0, 1)")
        if self.image_pad < 0:
            raise invalid("data.image_pad", self.image_pad, "use 0 (none) or a positive pixel count")
        if not 0.0 < self.mask_fraction < 1.0:
            raise invalid("data.mask_fraction", self.mask_fraction, "use a fraction in (0, 1), e.g. 0.15 as BERT")
        if self.length_multiple < 1:
            raise invalid("data.length_multiple", self.length_multiple, "use 1 (no rounding) or more, e.g. parallel.tp")


DATA_FORMATS = ("text", "chat", "prompt_completion", "preference")
LOSS_ON_BY_FORMAT = {"text": ("all",), "chat": ("assistant", "all"), "prompt_completion": ("completion", "all"),
                     "preference": ("completion",)}
"""data.loss_on's values by data.format, the default (empty loss_on) first."""
OVERLONG_ACTIONS = ("truncate", "drop", "error")


def loss_on_of(data_cfg) -> str:
    """data.loss_on, its empty default resolved by data.format."""
    return data_cfg.loss_on or LOSS_ON_BY_FORMAT[data_cfg.format][0]


IMAGE_SOURCES = ("digits",)
"""The image data sources (data/images.py): scikit-learn's bundled digits."""

PARALLEL_MODES = ("manual", "auto")


@dataclass(kw_only=True)
class ParallelConfig:
    """How the work is split over devices. The world size comes from the launcher
    (`shardwise train --nproc N`, torchrun or Slurm); `distributed.dims.ParallelDims` checks the
    degrees against it."""

    dp: int = 0
    """Data-parallel degree (replicas or ZeRO shards); 0 = what tp*cp*pp leave of the world size."""
    dp_replicate: int = 1
    """HSDP: replicate across this many groups, shard (ZeRO-3) within each; needs zero = 3."""
    zero: int = 0
    """ZeRO stage over the data-parallel axis: 0 replicated, 1 optimizer states, 2 + gradients, 3 + parameters."""
    bucket_mb: float = float(DEFAULT_BUCKET_MB)
    """Gradient bucket size in MiB: one collective per bucket, launched as soon as its gradients are ready."""
    tp: int = 1
    """Tensor-parallel degree."""
    sp: bool = False
    """Sequence parallelism for norms and the residual stream (needs tp > 1)."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks (1/cp of every activation each)."""
    cp_mode: str = "ring"
    """Context-parallel attention: ring (key/value blocks passed around the ranks) or alltoall
    (Ulysses: heads scattered, sequence gathered; needs heads and kv heads divisible by tp x cp)."""
    cp_load_balance: bool = True
    """Ring attention: zigzag chunks (rank r holds chunks r and 2cp-1-r of 2cp), so causal work is even."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe (all forward, all backward), 1f1b, interleaved-1f1b, zero-bubble
    (interleaved, backward split into input and weight gradients) or zbv (zero-bubble, V-shaped)."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (interleaved schedules): the model is cut into pp x this many stages."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts models): experts split over this many of the dp x cp
    ranks, tokens exchanged by all-to-all; must divide dp x cp and model.n_experts."""
    mode: str = "manual"
    """"manual" uses the degrees above; "auto" lets the planner choose them (shardwise/train/auto_layout.py)."""
    hardware: str = ""
    """With mode = "auto": the hardware the planner assumes, a preset (h100-80gb, h200-141gb, a100-40gb,
    a100-80gb, cpu) or a file written by `shardwise calibrate`; empty = cpu on CPU, the GPU's preset on GPUs."""

    def validate(self) -> None:
        require_positive("parallel", self, "dp_replicate", "tp", "cp", "pp", "pp_virtual_stages", "ep")
        if not isinstance(self.dp, int) or self.dp < 0:
            raise invalid("parallel.dp", self.dp, "use 0 (fill the world size) or a positive integer")
        if self.zero not in ZERO_STAGES:
            raise invalid("parallel.zero", self.zero, "use 0, 1, 2 or 3")
        if not self.bucket_mb > 0:
            raise invalid("parallel.bucket_mb", self.bucket_mb, "use a positive size in MiB")
        if self.pp_schedule not in PP_SCHEDULES:
            raise invalid("parallel.pp_schedule", self.pp_schedule, f"use one of {', '.join(PP_SCHEDULES)}")
        if self.cp_mode not in CP_MODES:
            raise invalid("parallel.cp_mode", self.cp_mode, f"use one of {', '.join(CP_MODES)}")
        if self.mode not in PARALLEL_MODES:
            raise invalid("parallel.mode", self.mode, f"use one of {', '.join(PARALLEL_MODES)}")
        # The rules shared with the planner (config/layout_rules.py), in its order: meaningless
        # combinations first, then what the runtime does not run yet.
        for violation in parallel_violations(tp=self.tp, pp=self.pp, zero=self.zero, dp_replicate=self.dp_replicate,
                                             sp=self.sp, pp_schedule=self.pp_schedule,
                                             virtual_stages=self.pp_virtual_stages, dp=self.dp):
            raise invalid(CONFIG_NAMES[violation.field], violation.value, violation.fix_for(CONFIG_NAMES))


DTYPES = ("float32", "bfloat16")
OBJECTIVE_CHOICES = ("auto", "dpo")


def sequences_per_sample(cfg) -> int:
    """Sequences the model runs per sample of train.global_batch_size: a DPO pair is two (chosen, rejected)."""
    return 2 if cfg.train.objective == "dpo" else 1


def lora_target_names(text: str) -> list[str]:
    """train.lora_targets as a list of role names."""
    return [name.strip() for name in text.split(",") if name.strip()]
NONFINITE_ACTIONS = ("stop", "skip")
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
"""`train.float8`: torchao's float8 training recipes (one scale per tensor, or per row of each operand)."""


def signals_named(field_name: str, text: str) -> list[signal.Signals]:
    """A comma-separated list of catchable signal names ("SIGTERM,USR1"; "" = none) as signals."""
    found = []
    for name in (part.strip().upper() for part in text.split(",") if part.strip()):
        name = name if name.startswith("SIG") else f"SIG{name}"
        value = getattr(signal, name, None)
        if not isinstance(value, signal.Signals) or name in ("SIGKILL", "SIGSTOP"):
            raise invalid(field_name, text, f"{name} is not a signal that can be caught; use names such as "
                                            "SIGTERM,SIGUSR1, or \"\" for none")
        found.append(value)
    return found


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps to run."""
    global_batch_size: int = 16
    """Sequences per optimizer step, over all data-parallel ranks and accumulation steps."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; global_batch_size / (micro_batch_size * dp) = accumulation steps."""
    seq_len: int = 128
    """Tokens per training sequence (must not exceed model.max_seq_len)."""
    stop_at_step: int = 0
    """Stop after this step (checkpointing it) without changing the LR schedule, e.g. to fit a
    job's time limit and resume later; 0 = run all train.steps."""
    seed: int = 0
    """Seed for the weights, the data order and sampling."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of lr."""
    warmup_steps: int = 30
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (applied to matrices, not to norms)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    recompute: str = "none"
    """Activation recomputation: none; full (each block keeps only its input and recomputes the rest
    in backward); selective (keeps the matmul outputs, recomputes element-wise ops and attention)."""
    autocast_dtype: str = "float32"
    """Compute dtype: float32, or bfloat16 autocast (weights and optimizer stay fp32)."""
    compile: bool = False
    """torch.compile each block in place (regional compilation, every layout but tensor parallelism
    with selective recomputation or with sequence parallelism and full recomputation). Off by
    default: on 2 CPU cores the demo's first step pays 19 s of compilation and its steps are no
    faster (median 0.452 s compiled vs 0.451 s eager, dp2, 80 steps, 2-core Intel Xeon, 2026-11-26); turn it on for
    long runs, and on GPUs."""
    float8: str = "none"
    """FP8 matmuls in training (torchao's float8 training, on an NVIDIA GPU with FP8 tensor cores:
    compute capability 8.9 or newer): "tensorwise" (one scale per tensor; fastest) or "rowwise" (a scale
    per row; closer to bf16). Every linear inside the blocks whose widths divide by 16 computes in
    float8; the embedding and the output head stay in high precision. Needs train.compile (eager
    float8 casts cost more than they save); not with tensor parallelism or LoRA."""
    rewrite_rules: bool = True
    """With train.compile: rewrite each block graph with the rules of shardwise/compile/rules/
    (RMSNorm, residual add + RMSNorm, SwiGLU, RoPE -> fused ops) before inductor; `shardwise rules`
    lists them and how often each fires on the model."""
    chunked_loss: bool = True
    """Take the output projection and the cross-entropy together a chunk of tokens at a time, never
    holding the [tokens, vocab] logits (models/common/chunked_loss.py); used where the model's plan
    offers it and the layout has no pipeline (whose schedule takes the last stage's logits); under
    tensor parallelism each rank chunks its columns of the vocabulary (their softmax statistics
    all-reduced), instead of loss_parallel over its [tokens, vocab / tp] logits.
    Same loss up to float rounding; false: logits, then the loss in fp32."""
    max_restarts: int = 1
    """`shardwise train --nproc N`: restart all ranks this many times after a rank dies (killed, crashed),
    each time from the newest valid checkpoint; bad input and a non-finite stop are not restarted.
    torchrun users: `torchrun --max-restarts`."""
    preempt_signals: str = "SIGTERM,SIGUSR1"
    """Signals that mean "pre-empted" (comma-separated; "" = none): finish the current step, save a
    checkpoint, exit with status 75 and one line; the rerun resumes from it. Under `--nproc` the launcher
    passes them on to every rank (and SIGKILLs ranks still running after TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s)."""
    stall_timeout_s: float = 600.0
    """`shardwise train --nproc N`: stop the job when no rank has made progress (finished a step, a save,
    its setup) for this long, naming the stalled rank(s) and the last step of each; then restart if
    train.max_restarts allows. 0 = never. The default leaves room for a first compiled step on a GPU."""
    rejoin_timeout_s: float = 30.0
    """`shardwise train --nnodes MIN:MAX`: after a failure, how long the restart waits for a lost node to come
    back before it goes on with the nodes left (the layout re-planned for the smaller world); torch's c10d
    rendezvous `last_call_timeout`. A node that comes back later joins at the next checkpoint."""
    on_nonfinite: str = "stop"
    """When the loss or the gradient norm is NaN or infinite: stop (with the step named; the newest
    checkpoint is untouched) or skip (no optimizer step, counted as `skipped` in metrics.jsonl)."""
    max_nonfinite_in_row: int = 3
    """With on_nonfinite = "skip": stop after this many non-finite steps in a row (diverged, not a spike)."""
    deterministic: bool = False
    """Ask torch for deterministic kernels (bit-exact reruns on the same machine)."""
    device: str = "auto"
    """Device to train on: auto (the accelerator if present, else cpu), cpu, cuda, cuda:1, ..."""
    log_every: int = 10
    """Print a line every this many steps when there is no live progress bar (metrics.jsonl gets every step)."""
    sample_tokens: int = 64
    """Tokens to generate at the end of training as a sample (0 = none; a causal LM's only: BERT and
    ViT do not generate)."""
    sample_prompt: str = "def "
    """Prompt of the end-of-training sample."""
    sample_temperature: float = 0.8
    """Sampling temperature of the end-of-training sample (0 = greedy, which loops on small models)."""
    sample_top_k: int = 50
    """Sample from the k most likely tokens; 0 = all."""

    init_from: str = ""
    """Start from pretrained weights: a Hugging Face model directory (config.json + safetensors, any family
    `shardwise convert --from-hf` reads) or a shardwise run directory, optionally RUN@STEP. model.* is read
    from it; the run starts at step 0 with a fresh optimizer, schedule and data position."""
    objective: str = "auto"
    """What to minimise: "auto" (the model family's: next-token cross-entropy for a decoder, on the tokens
    data.loss_on selects) or "dpo" (direct preference optimisation on data.format = "preference" pairs, the
    reference being the initial weights)."""
    dpo_beta: float = 0.1
    """DPO's beta: how far the policy may move from the reference (larger = closer)."""
    lora_rank: int = 0
    """LoRA: train rank-r adapters beside the frozen base linears of train.lora_targets; 0 = train every weight."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: an adapter adds (lora_alpha / lora_rank) x B A x."""
    lora_dropout: float = 0.0
    """LoRA: dropout on the adapters' input (training only)."""
    lora_targets: str = "q,k,v,o,gate,up,down"
    """LoRA: the roles of the linears that get adapters, comma-separated names of the family's plan
    (llama: q,k,v,o,gate,up,down)."""
    lora_base_dtype: str = "float32"
    """LoRA: the dtype the frozen base weights are held in (bfloat16 halves their memory)."""

    eval_every: int = 0
    """With data.val_fraction > 0: evaluate on the validation split every this many steps and after the
    last step (val_loss and val_ppl, and a classifier's val_accuracy, in metrics.jsonl, the progress
    line and every logger); 0 = only after the last step."""
    eval_batches: int = 4
    """Global batches (train.global_batch_size sequences each, the same ones every time) per evaluation."""

    def validate(self) -> None:
        require_positive("train", self, "eval_batches")
        if self.eval_every < 0:
            raise invalid("train.eval_every", self.eval_every, "use 0 (only after the last step) or a step count")
        require_positive("train", self, "steps", "global_batch_size", "micro_batch_size", "seq_len", "log_every")
        if self.global_batch_size % self.micro_batch_size:
            raise invalid(
                "train.global_batch_size", self.global_batch_size,
                f"use a multiple of train.micro_batch_size ({self.micro_batch_size})",
            )
        if not self.lr > 0:
            raise invalid("train.lr", self.lr, "use a positive learning rate")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise invalid("train.min_lr_ratio", self.min_lr_ratio, "use a fraction in [0, 1]")
        if self.warmup_steps < 0:
            raise invalid("train.warmup_steps", self.warmup_steps, "use 0 or more")
        if self.grad_clip < 0:
            raise invalid("train.grad_clip", self.grad_clip, "use 0 (off) or a positive norm")
        if self.weight_decay < 0:
            raise invalid("train.weight_decay", self.weight_decay, "use 0 or more")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise invalid(f"train.{name}", getattr(self, name), "use a value in [0, 1)")
        if not self.eps > 0:  # 0 divides by zero where a gradient's second moment is 0
            raise invalid("train.eps", self.eps, "use a small positive value, e.g. 1e-8")
        if self.recompute not in RECOMPUTE_MODES:
            raise invalid("train.recompute", self.recompute, f"use one of {', '.join(RECOMPUTE_MODES)}")
        if self.autocast_dtype not in DTYPES:
            raise invalid("train.autocast_dtype", self.autocast_dtype, f"use one of {', '.join(DTYPES)}")
        if self.float8 not in FLOAT8_RECIPES:
            raise invalid("train.float8", self.float8, f"use one of {', '.join(FLOAT8_RECIPES)}")
        if self.float8 != "none" and not self.compile:
            raise invalid("train.float8", self.float8, "float8 training needs train.compile = true (its casts "
                          "and scales must fuse into the matmuls to gain anything); set it, or train.float8 = \"none\"")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise invalid("train.on_nonfinite", self.on_nonfinite, f"use one of {', '.join(NONFINITE_ACTIONS)}")
        require_positive("train", self, "max_nonfinite_in_row")
        if not 0 < self.rejoin_timeout_s <= 86400:  # NaN and inf too: torch's rendezvous takes whole seconds
            raise invalid("train.rejoin_timeout_s", self.rejoin_timeout_s, "use a positive number of seconds, at "
                          "most 86400")
        if self.stall_timeout_s < 0:
            raise invalid("train.stall_timeout_s", self.stall_timeout_s, "use 0 (never) or a number of seconds")
        signals_named("train.preempt_signals", self.preempt_signals)
        if self.max_restarts < 0:
            raise invalid("train.max_restarts", self.max_restarts, "use 0 (never restart) or more")
        if self.seed < 0:
            raise invalid("train.seed", self.seed, "use a non-negative integer")
        if not 0 <= self.stop_at_step <= self.steps:
            raise invalid("train.stop_at_step", self.stop_at_step,
                          f"use 0 (run all steps) or a step number up to train.steps ({self.steps})")
        if not 0 <= self.sample_temperature <= 2:
            raise invalid("train.sample_temperature", self.sample_temperature, "use a value from 0 (greedy) to 2")
        if self.sample_top_k < 0:
            raise invalid("train.sample_top_k", self.sample_top_k, "use 0 (all tokens) or a positive count")
        if self.sample_tokens < 0:
            raise invalid("train.sample_tokens", self.sample_tokens, "use 0 (no sample) or more")
        self.validate_adapting()

    def validate_adapting(self) -> None:
        """The objective, DPO and LoRA fields."""
        if self.objective not in OBJECTIVE_CHOICES:
            raise invalid("train.objective", self.objective, f"use one of {', '.join(OBJECTIVE_CHOICES)}")
        if not self.dpo_beta > 0:
            raise invalid("train.dpo_beta", self.dpo_beta, "use a positive value, e.g. 0.1")
        if self.lora_rank < 0:
            raise invalid("train.lora_rank", self.lora_rank, "use 0 (no LoRA: train every weight) or a rank, e.g. 8")
        if not self.lora_alpha > 0:
            raise invalid("train.lora_alpha", self.lora_alpha, "use a positive scale, e.g. 16")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise invalid("train.lora_dropout", self.lora_dropout, "use a probability in [0, 1)")
        if self.lora_rank and not lora_target_names(self.lora_targets):
            raise invalid("train.lora_targets", self.lora_targets, "name the roles that get adapters, e.g. q,k,v,o")
        if self.lora_base_dtype not in DTYPES:
            raise invalid("train.lora_base_dtype", self.lora_base_dtype, f"use one of {', '.join(DTYPES)}")


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many steps (0 = only at the end)."""
    keep: int = 2
    """How many of the newest checkpoints to keep."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory if there is one. false: train from step 0,
    refused where run.dir holds checkpoints unless checkpoint.overwrite (a run directory holds one run)."""
    overwrite: bool = False
    """With checkpoint.resume = false: move the run already in run.dir (its checkpoints, metrics and the
    rest) aside into RUN/previous/<time>/ and start over; nothing is deleted."""
    at_end: bool = True
    """Save a checkpoint after the last step."""
    async_save: bool = False
    """Write the periodic checkpoints in the background (torch.distributed.checkpoint.async_save): the
    step pays for a copy of the state to host memory, a thread writes the files, and the checkpoint
    is completed (manifest, rename) at the next save. The last save and a pre-emption save are synchronous."""
    quantization: str = ""
    """Written by `shardwise quantize`, not by training: the run's checkpoints hold weight-only
    quantized linears, "int8" or "int4" (for serving only); "" = float weights."""
    quantization_group_size: int = 0
    """With checkpoint.quantization = "int4": the input columns that share one scale and zero point
    (32, 64, 128 or 256); 0 otherwise."""

    def validate(self) -> None:
        if self.quantization not in ("", "int8", "int4"):
            raise invalid("checkpoint.quantization", self.quantization,
                          'use "" (float weights); "int8" and "int4" are written by `shardwise quantize`')
        groups = (32, 64, 128, 256) if self.quantization == "int4" else (0,)
        if self.quantization_group_size not in groups:
            raise invalid("checkpoint.quantization_group_size", self.quantization_group_size,
                          f"use {' or '.join(map(str, groups))} with checkpoint.quantization = {self.quantization!r}")
        if self.every < 0:
            raise invalid("checkpoint.every", self.every, "use 0 (only at the end) or a positive step count")
        require_positive("checkpoint", self, "keep")
        if self.overwrite and self.resume:
            raise invalid("checkpoint.overwrite", True, "it moves the run in run.dir aside to start over, which "
                                                        "checkpoint.resume = true does not; add --checkpoint.resume false")


@dataclass(kw_only=True)
class RunConfig:
    dir: str = "runs/demo"
    """Run directory: config, tokenizer, metrics.jsonl and checkpoints are written here."""
    name: str = "demo"
    """A label for the run, shown in logs."""
    progress: bool = True
    """Show a live progress bar on a terminal; otherwise (or piped to a file) one plain line per
    train.log_every steps."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where the metrics go, besides metrics.jsonl (always written): "tensorboard" (event files in
    RUN/tensorboard, pip extra shardwise[tensorboard]) and "wandb" (Weights & Biases, pip extra
    shardwise[wandb]; WANDB_MODE=offline keeps it local). Rank 0 writes. On the command line: jsonl,tensorboard."""
    wandb_project: str = "shardwise"
    """The W&B project of run.loggers = wandb (the run is named run.name)."""
    profile_steps: str = ""
    """Profile these steps, "A-B" or "A": a torch.profiler trace per rank in RUN/profile/rank<r>.json
    (open it in Perfetto or chrome://tracing), a table of the top operators and collectives, and on
    CUDA a memory snapshot for pytorch.org/memory_viz. Empty = no profiling."""

    def validate(self) -> None:
        if not self.dir.strip():
            raise invalid("run.dir", self.dir, "name a directory for the run's outputs")
        for name in self.loggers:
            if name not in LOGGERS:
                raise invalid("run.loggers", self.loggers, f"use a list of {', '.join(LOGGERS)}")
            module = LOGGERS[name]
            if module and importlib.util.find_spec(module) is None:
                raise invalid("run.loggers", self.loggers,
                              f"{name} needs the {module} package: pip install 'shardwise[{name}]'")
        profiled_steps(self.profile_steps)


LOGGERS = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb"}
"""Logger name -> the package it needs (None: built in)."""


def profiled_steps(text: str) -> tuple[int, int] | None:
    """run.profile_steps "A-B" (or "A") as (A, B); "" as None."""
    if not text.strip():
        return None
    first, _, last = text.strip().partition("-")
    if not first.strip().isdigit() or (last and not last.strip().isdigit()):
        raise invalid("run.profile_steps", text, 'use "A-B" (steps A to B) or "A" (one step), e.g. "5-7"')
    first_step, last_step = int(first), int(last or first)
    if not 1 <= first_step <= last_step:
        raise invalid("run.profile_steps", text, "use 1 <= A <= B")
    return first_step, last_step


@dataclass(kw_only=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> "Config":
        if self.model.preset not in PRESETS:
            raise invalid("model.preset", self.model.preset, f"use one of {', '.join(PRESETS)}")
        for section in dataclasses.fields(self):
            require_representable(section.name, getattr(self, section.name))
            if section.name == "model":
                validate_model(self.model)  # with its family's spec
            else:
                getattr(self, section.name).validate()
        if self.train.eval_every and not self.data.val_fraction:
            raise invalid("train.eval_every", self.train.eval_every,
                          "evaluation needs a validation split: set data.val_fraction (e.g. 0.05), or train.eval_every = 0")
        profiled = profiled_steps(self.run.profile_steps)
        if profiled and profiled[1] > self.train.steps:
            raise invalid("run.profile_steps", self.run.profile_steps, f"profile steps within train.steps ({self.train.steps})")
        if self.train.seq_len > self.model.max_seq_len:
            raise invalid(
                "train.seq_len", self.train.seq_len,
                f"use at most model.max_seq_len ({self.model.max_seq_len}) or raise model.max_seq_len",
            )
        self.validate_family_data()
        self.validate_post_training()
        self.validate_float8()
        if not spec_of(self.model.family).image_input and not self.data.tokenizer and self.data.vocab_size > self.model.vocab_size:
            raise invalid(
                "data.vocab_size", self.data.vocab_size,
                f"use at most model.vocab_size ({self.model.vocab_size}) or raise model.vocab_size",
            )
        return self

    def validate_family_data(self) -> None:
        """An image model trains on images (and sees all of each), a text model on text."""
        source, spec = self.data.source.strip(), spec_of(self.model.family)
        if spec.image_input:
            if source not in IMAGE_SOURCES:
                raise invalid("data.source", self.data.source,
                              f"model.family {spec.name} trains on images: use one of {', '.join(IMAGE_SOURCES)}")
            if self.train.seq_len != self.model.max_seq_len:
                raise invalid("train.seq_len", self.train.seq_len,
                              f"a ViT sees each image whole: use model.max_seq_len ({self.model.max_seq_len}, "
                              "its patches and the class token)")
        elif source in IMAGE_SOURCES:
            raise invalid("data.source", self.data.source,
                          f"it holds images, which model.family {self.model.family} cannot read: use text, or "
                          f"model.family {' or '.join(name for name, other in SPECS.items() if other.image_input)}")
        if self.data.length_multiple != 1 and spec.objective != "span_corruption":
            raise invalid("data.length_multiple", self.data.length_multiple,
                          f"it rounds span-corrupted lengths, which model.family {self.model.family} does not train "
                          "on: leave it at 1")
        if self.data.image_pad and not spec.image_input:
            raise invalid("data.image_pad", self.data.image_pad,
                          f"it pads images, which model.family {self.model.family} does not read: leave it at 0")

    def validate_post_training(self) -> None:
        """Chat, instruction and preference data, packing and DPO: what each needs of the rest."""
        data, train, spec = self.data, self.train, spec_of(self.model.family)
        adapted = data.format != "text" or data.document_mask
        if adapted and spec.objective != "causal_lm":
            field_name = "data.format" if data.format != "text" else "data.document_mask"
            raise invalid(field_name, getattr(data, field_name.split(".")[1]),
                          f"model.family {self.model.family} trains a {spec.objective.replace('_', ' ')}; chat, "
                          "instruction, preference data and document masks are for decoders (llama, gpt2)")
        if (train.objective == "dpo") != (data.format == "preference"):
            raise invalid("train.objective", train.objective,
                          'DPO trains on preference pairs: use train.objective = "dpo" with data.format = '
                          f'"preference" (data.format is {data.format})')
        if train.lora_rank:
            self.validate_lora(spec)
        if train.objective == "dpo":
            self.validate_dpo()
        if (data.packing or data.document_mask) and self.parallel.cp > 1:
            field_name = "data.packing" if data.packing else "data.document_mask"
            raise invalid(field_name, True, "context parallelism's ring and all-to-all attention take no document "
                                            "mask yet: use parallel.cp = 1 (tp, pp and dp all take it)")

    def validate_dpo(self) -> None:
        """DPO's loss needs each sequence's whole log-probability on one rank, then both of a pair's
        (train/dpo.py): pipeline and context parallelism split those; and it evaluates no held-out pairs."""
        parallel = self.parallel
        if parallel.pp > 1:
            raise invalid("parallel.pp", parallel.pp, "DPO's loss needs both sequences of a pair whole, but the "
                                                      "pipeline schedule takes a per-token loss on its last stage: "
                                                      "use parallel.pp = 1 (dp, ZeRO and tp take DPO)")
        if parallel.cp > 1:
            raise invalid("parallel.cp", parallel.cp, "DPO's loss sums each sequence's log-probabilities, which "
                                                      "context parallelism splits over ranks: use parallel.cp = 1 "
                                                      "(dp, ZeRO and tp take DPO)")
        if self.data.val_fraction:
            raise invalid("data.val_fraction", self.data.val_fraction, "DPO runs evaluate no held-out pairs: use 0")

    def validate_float8(self) -> None:
        """What float8 training composes with: not tensor parallelism (its styles would need torchao's
        float8 variants) nor LoRA (the frozen base is not trained; its adapters are too narrow)."""
        recipe = self.train.float8
        if recipe == "none":
            return
        if self.parallel.tp > 1:
            raise invalid("train.float8", recipe, f"float8 training does not run with tensor parallelism "
                          f"(parallel.tp = {self.parallel.tp}): use parallel.tp = 1 (data parallel or ZeRO shard "
                          "the model instead), or train.float8 = \"none\"")
        if self.train.lora_rank:
            raise invalid("train.float8", recipe, "float8 training does not train LoRA adapters "
                          f"(train.lora_rank = {self.train.lora_rank}): use train.float8 = \"none\"")

    def validate_lora(self, spec) -> None:
        """LoRA targets are roles of the family's plan (its spec's `lora_roles`)."""
        train = self.train
        if not spec.lora_roles:
            raise invalid("train.lora_rank", train.lora_rank,
                          f"model.family {spec.name} takes no LoRA adapters: use 0 (train every weight)")
        unknown = [role for role in lora_target_names(train.lora_targets) if role not in spec.lora_roles]
        if unknown:
            raise invalid("train.lora_targets", train.lora_targets,
                          f"{', '.join(unknown)} {'is not a role' if len(unknown) == 1 else 'are not roles'} of "
                          f"model.family {spec.name}: use roles among "
                          f"{', '.join(spec.lora_roles)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {name: kind for name, kind in typing.get_type_hints(Config).items()}
"""Section name -> its Config dataclass, in file order."""
