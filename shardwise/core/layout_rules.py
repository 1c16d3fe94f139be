"""The layout rules, written once: which degrees, schedules and model sizes go together.

Used by the config (`ParallelConfig.validate`), the runtime's checks before any work
(`layout_checks.py`, which `distributed/*`'s check functions call) and the planner
(`Layout.validate`, `Layout.check_against`, `search.runtime_refuses`,
`search.candidate_degrees`). Pure Python over plain numbers: the planner imports it without torch.

Each rule yields a `Violation`: the layout field it is about, its value, the fix, and whether
it is a *runtime limit* (a well-formed layout that the planner can estimate but the shardwise
runtime does not run yet; `shardwise plan --all-layouts` keeps those). A fix names fields as
`{tp}`, `{zero}`, ...; `Violation.fix_for(names)` spells them the caller's way ("parallel.tp"
in the config, "tp" in a planner layout), and each caller adds its own prefix. Callers raise
the first violation of the rules they apply. Where a caller's wording is pinned (the planner's
recorded outputs), it words a violation itself from `rule` and `facts`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from shardwise.core.family import FamilySpec

PP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv")
INTERLEAVED_SCHEDULES = ("interleaved-1f1b", "zero-bubble", "zbv")
"""Schedules that place several stages on each rank (`virtual_stages` > 1)."""
ROUNDS_SCHEDULES = ("interleaved-1f1b", "zero-bubble")
"""Schedules that run micro-batches in rounds of pp."""
CP_MODES = ("ring", "alltoall")
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "full", "selective")
RECOMPUTE_BY_COST = ("none", "selective", "full")
"""The same modes, least recomputation first (the planner tries them in this order)."""

CONFIG_NAMES = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp", "ep": "parallel.ep",
    "zero": "parallel.zero", "sp": "parallel.sp", "dp_replicate": "parallel.dp_replicate",
    "pp_schedule": "parallel.pp_schedule", "virtual_stages": "parallel.pp_virtual_stages",
    "cp_mode": "parallel.cp_mode", "seq_len": "train.seq_len", "micro_batch": "train.micro_batch_size",
    "global_batch": "train.global_batch_size", "tie_embeddings": "model.tie_embeddings",
    "recompute": "train.recompute", "compile": "train.compile",
}
"""Layout field -> its name in the config file and on the command line."""


@dataclass(frozen=True)
class Violation:
    rule: str
    """A stable name of the rule, for callers that word it themselves."""
    field: str
    """The layout field it is about (a key of CONFIG_NAMES)."""
    value: object
    fix: str
    runtime_limit: bool = False
    facts: dict = field(default_factory=dict)
    """The numbers the fix quotes, by name."""

    def fix_for(self, names: Mapping[str, str]) -> str:
        return self.fix.format_map(names)


class LayoutNames(dict):
    """Field names as the planner spells them: the layout keys themselves."""

    def __missing__(self, key: str) -> str:
        return key


def parallel_violations(*, tp: int, pp: int, zero: int, dp_replicate: int, sp: bool, pp_schedule: str,
                        virtual_stages: int, dp: int = 0) -> Iterator[Violation]:
    """Rules over the degrees alone (dp = 0: not known yet), in the config's order: meaningless
    combinations first, runtime limits last."""
    if sp and tp == 1:
        yield Violation("sp_needs_tp", "sp", sp, "sequence parallelism needs {tp} > 1")
    if dp_replicate > 1 and zero != 3:
        yield Violation("hsdp_needs_zero3", "dp_replicate", dp_replicate,
                        "HSDP shards parameters inside each group: set {zero} = 3 (or dp_replicate = 1)")
    if dp and dp % dp_replicate:
        yield Violation("dp_replicate_divides_dp", "dp_replicate", dp_replicate, f"use a divisor of {{dp}} ({dp})")
    if tp > 1 and zero in (1, 2):
        yield Violation("zero12_with_tp", "zero", zero, "ZeRO-1/2 are written for replicated parameters; "
                        "with {tp} > 1 use zero 0 or 3", runtime_limit=True)
    if virtual_stages > 1 and pp_schedule not in INTERLEAVED_SCHEDULES:
        yield Violation("virtual_stages_need_interleaving", "virtual_stages", virtual_stages,
                        f"{pp_schedule} runs one stage per rank; use 1, or pp_schedule = interleaved-1f1b")
    if pp_schedule == "zbv" and pp > 1 and virtual_stages != 2:
        yield Violation("zbv_two_stages", "virtual_stages", virtual_stages,
                        "the zbv schedule places exactly 2 stages per rank (a V); set it to 2")
    if pp > 1 and sp:
        yield Violation("sp_with_pp", "sp", sp, "sequence parallelism does not yet pass sequence-sharded hidden "
                        "states between pipeline stages; with {pp} > 1 set {sp} = false", runtime_limit=True)
    if pp > 1 and zero == 2:
        yield Violation("zero2_with_pp", "zero", zero, "ZeRO-2 frees gradients between micro-batches, which the "
                        "pipeline schedule interleaves; with {pp} > 1 use zero 0, 1 or 3")


# -- tensor parallelism -------------------------------------------------------------------------


def tp_split_sizes(model) -> dict[str, int]:
    """The sizes tensor parallelism splits evenly, by model field. Not the vocabulary (the rows of
    the embedding and output head, the logits' columns): DTensor's Shard cuts a size that does not
    divide as `torch.chunk` does (GPT-2's 50,257 over 2: 25,129 and 25,128 rows), and the
    vocabulary-parallel embedding and `loss_parallel` follow each rank's offset (`vocab_violations`)."""
    return {"n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads, "ffn_dim": model.ffn_dim}


def tp_violations(tp: int, sizes: Mapping[str, int]) -> Iterator[Violation]:
    """Each size must split into whole heads / columns over tp ranks."""
    for name, size in sizes.items():
        if size % tp:
            yield Violation("tp_divides", "tp", tp, f"model.{name} = {size} does not divide by it; "
                            f"use a tp that divides {size}", facts={"size_field": name, "size": size})


def tp_shape_violations(tp: int, model, spec: FamilySpec) -> Iterator[Violation]:
    """What a model's shape needs of tp (a ModelConfig and its family's spec): whole heads and FFN
    columns on each rank, and some vocabulary rows (an image model has no vocabulary)."""
    yield from tp_violations(tp, tp_split_sizes(model))
    if not spec.image_input:
        yield from vocab_violations(tp, model.vocab_size)


def vocab_violations(tp: int, vocab_size: int) -> Iterator[Violation]:
    """The vocabulary splits over tp ranks in `torch.chunk`'s pieces of ceil(vocab / tp) rows; every
    rank must get some (9 over 4 would give 3, 3, 3 and none)."""
    piece = -(-vocab_size // tp)
    if piece * (tp - 1) >= vocab_size:
        largest = next(t for t in range(tp, 0, -1) if -(-vocab_size // t) * (t - 1) < vocab_size)
        yield Violation("tp_vocab_rows", "tp", tp, f"model.vocab_size = {vocab_size} leaves a rank without "
                        f"vocabulary rows (pieces of {piece}); use a tp of at most {largest}")


# -- context parallelism ------------------------------------------------------------------------


def cp_chunks(cp: int, cp_mode: str, *, load_balance: bool) -> int:
    """Chunks each sequence is cut into: 2cp zigzag chunks for load-balanced ring attention, else cp."""
    if cp == 1:
        return 1
    return 2 * cp if cp_mode == "ring" and load_balance else cp


def sequence_violations(*, seq_len: int, tp: int, sp: bool, cp: int, cp_mode: str,
                        load_balance: bool = True) -> Iterator[Violation]:
    """Each sequence cuts into whole chunks: cp_chunks over context parallelism, each split over
    tp again with sequence parallelism."""
    chunks = cp_chunks(cp, cp_mode, load_balance=load_balance)
    split = tp if sp else 1
    if seq_len % (chunks * split) == 0:
        return
    if chunks == 1:
        yield Violation("seq_splits_over_tp", "seq_len", seq_len, f"sequence parallelism splits each sequence over "
                        f"{{tp}} = {tp} ranks: use a multiple of {tp}")
        return
    per = f"{chunks} chunks" + (f" x {{tp}} = {tp} (sequence parallel)" if sp else "")
    yield Violation("seq_splits_over_cp", "seq_len", seq_len, f"context parallelism ({cp_mode}, cp = {cp}) cuts "
                    f"each sequence into {per}; use a multiple of {chunks * split}")


def alltoall_head_violations(cp: int, tp: int, heads: Mapping[str, int]) -> Iterator[Violation]:
    """All-to-all (Ulysses) context parallelism gives each of the tp x cp ranks whole heads. Too few
    key/value heads is a runtime limit: they could be repeated up to tp x cp, which shardwise does not do yet."""
    for name, count in heads.items():
        if count % (tp * cp):
            per_tp = count // tp if count % tp == 0 else count
            yield Violation("alltoall_heads", "cp", cp,
                            f"all-to-all context parallelism splits the heads over cp ranks (after tp = {tp}): "
                            f"model.{name} = {count} does not divide by tp x cp = {tp * cp}; use a cp that divides "
                            f"{per_tp}, or {{cp_mode}} = \"ring\"",
                            runtime_limit=name == "n_kv_heads", facts={"heads_field": name, "heads": count})


def cp_head_violations(*, cp: int, tp: int, cp_mode: str, model) -> Iterator[Violation]:
    """The head rule of the layout's context parallelism: only all-to-all splits heads."""
    if cp_mode == "alltoall" and cp > 1:
        yield from alltoall_head_violations(cp, tp, {"n_heads": model.n_heads, "n_kv_heads": model.n_kv_heads})


def cp_window_violations(*, cp: int, cp_mode: str, sliding_window: int) -> Iterator[Violation]:
    """Ring attention computes full causal attention block by block and has no sliding window;
    all-to-all attends whole sequences on each rank, where the single-process mask holds."""
    if cp > 1 and cp_mode == "ring" and sliding_window:
        yield Violation("ring_sliding_window", "cp_mode", cp_mode,
                        f"ring attention has no sliding window (model.sliding_window = {sliding_window}) yet: "
                        "use {cp_mode} = \"alltoall\" or {cp} = 1", runtime_limit=True,
                        facts={"sliding_window": sliding_window})


def cp_family_violations(*, cp: int, spec: FamilySpec) -> Iterator[Violation]:
    """Context parallelism's attention cores (ring, all-to-all) are causal; an encoder's queries
    need every key, and its sequences (BERT's 512 tokens, ViT's patches) are short enough not to."""
    if cp > 1 and spec.bidirectional:
        yield Violation("cp_bidirectional", "cp", cp,
                        f"context parallelism splits causal attention, and model.family {spec.name} attends both ways: "
                        "use {cp} = 1 (its sequences fit one rank)", runtime_limit=True, facts={"family": spec.name})


# -- expert parallelism -------------------------------------------------------------------------


def expert_violations(*, ep: int, n_experts: int, sp: bool, dp_replicate: int, data_ranks: int) -> Iterator[Violation]:
    """Experts split over ep ranks carved from the data (dp x cp) ranks; the runtime's order."""
    if sp and n_experts:
        yield Violation("sp_with_moe", "sp", True, "MoE layers take whole sequences, not sequence-parallel "
                        "shards: set sp = false", runtime_limit=True)
    if ep == 1:
        return
    yield from expert_split_violations(ep, n_experts)
    yield from expert_rank_violations(ep, data_ranks)
    if dp_replicate > 1:
        yield Violation("hsdp_with_ep", "dp_replicate", dp_replicate, "HSDP with {ep} > 1 is not supported: use 1",
                        runtime_limit=True)


def expert_split_violations(ep: int, n_experts: int) -> Iterator[Violation]:
    if ep == 1:
        return
    if not n_experts:
        yield Violation("ep_needs_experts", "ep", ep, "the model is dense (no experts); use 1")
    elif n_experts % ep:
        yield Violation("ep_divides_experts", "ep", ep, f"model.n_experts = {n_experts} must divide by it; "
                        "use a divisor", facts={"n_experts": n_experts})


def expert_rank_violations(ep: int, data_ranks: int) -> Iterator[Violation]:
    if data_ranks % ep:
        yield Violation("ep_divides_data_ranks", "ep", ep, f"ep is carved from the dp x cp = {data_ranks} data "
                        f"ranks: use a divisor of {data_ranks}", facts={"data_ranks": data_ranks})


# -- pipeline parallelism -----------------------------------------------------------------------


def stage_count_violations(*, pp: int, num_stages: int, n_layers: int) -> Iterator[Violation]:
    """Every stage needs at least one block (the runtime's error is `stage_split.check_stage_count`)."""
    if num_stages < 1 or num_stages > n_layers:
        yield Violation("stages_fit_layers", "pp", pp, f"{{pp}} x {{virtual_stages}} = {num_stages} exceeds "
                        f"model.n_layers ({n_layers}); use fewer stages",
                        facts={"num_stages": num_stages, "n_layers": n_layers})


MICRO_BATCH_FIX = "raise train.global_batch_size or lower train.micro_batch_size"


def sp_family_violations(*, sp: bool, spec: FamilySpec, tp: int = 1, length_multiple: int = 1) -> Iterator[Violation]:
    """An encoder-decoder's (T5's) encoder and decoder sequences have the lengths span corruption gives
    them (seq_len - 2n + 1 and 4n + 1 for n spans), which split evenly over the tp ranks only when
    `data.length_multiple` rounds them to a multiple of tp. The planner does not set data fields: it
    passes 1, and refuses."""
    if sp and spec.encoder_decoder and length_multiple % tp:
        yield Violation("sp_encoder_decoder", "sp", sp, "sequence parallelism splits each sequence over the tp ranks, "
                        "and T5's span-corrupted inputs and targets have odd lengths: set data.length_multiple to a "
                        f"multiple of {{tp}} (now {length_multiple}; the inputs are cut and the targets padded to it), "
                        "or use {sp} = false", runtime_limit=True, facts={"family": spec.name})


def pipeline_family_violations(*, pp: int, spec: FamilySpec) -> Iterator[Violation]:
    """An encoder-decoder's decoder blocks each read the encoder's output besides their own input; a
    pipeline stage hands on one activation."""
    if pp > 1 and spec.encoder_decoder:
        yield Violation("pp_encoder_decoder", "pp", pp, "pipeline stages hand on one activation, and every T5 "
                        "decoder block also reads the encoder's output: use {pp} = 1 (dp, ZeRO and tp split T5)",
                        runtime_limit=True, facts={"family": spec.name})


def pipeline_violations(*, pp: int, pp_schedule: str, num_micro_batches: int,
                        tie_embeddings: bool = False) -> Iterator[Violation]:
    """What a pipeline schedule needs of the model and of the micro-batches per rank and step."""
    if pp == 1:
        return
    m = num_micro_batches
    if tie_embeddings and pp_schedule == "zbv":
        yield Violation("zbv_tied", "tie_embeddings", True, "zbv puts the first and last stages on one rank, which "
                        "would hold two copies of the tied table; use another schedule or model.tie_embeddings = false",
                        runtime_limit=True)
    if pp_schedule != "gpipe" and m < pp:
        yield Violation("micro_batches_fill_pipeline", "global_batch", m, f"the {pp_schedule} schedule needs at least "
                        f"parallel.pp = {pp} micro-batches per data-parallel rank and step, and this batch gives {m}; "
                        f"{MICRO_BATCH_FIX}", runtime_limit=True)
    rounds = max(1, m // pp)
    if pp_schedule in ROUNDS_SCHEDULES and m % rounds:
        yield Violation("micro_batches_in_rounds", "global_batch", m, f"the {pp_schedule} schedule runs micro-batches "
                        f"in rounds of pp = {pp}: {m} micro-batches per rank and step must be a multiple of {rounds}; "
                        f"{MICRO_BATCH_FIX}", runtime_limit=True)


SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv")
"""Schedules that run each block's input-gradient and weight-gradient backward separately."""


def compile_violations(*, compile: bool, tp: int, sp: bool, recompute: str) -> Iterator[Violation]:
    """Where compiled blocks (`train.compile`) do not run yet; all runtime limits."""
    if not compile:
        return
    if tp > 1 and (recompute == "selective" or (recompute == "full" and sp)):
        yield Violation("compile_tp_recompute", "recompute", recompute, "compiled blocks under tensor parallelism "
                        "run with full recomputation only without sequence parallelism yet (a checkpoint traced "
                        "into the block saves DTensors, which AOTAutograd refuses in torch 2.13; full "
                        "recomputation around compiled parts with sequence parallelism gave losses 5e-5 off one "
                        "process): set {recompute} = none (or full with {sp} = false), {compile} = false or "
                        "{tp} = 1", runtime_limit=True)
