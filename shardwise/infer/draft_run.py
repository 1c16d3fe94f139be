"""The draft run of `--speculate draft:RUN`, checked against the served run before any model loads
(`load.open_engine` then picks its checkpoint on every rank, the integrity check being collective, and
loads it on the leading rank only: the draft is small and runs unsplit beside a tensor-parallel target;
the followers never see its steps)."""

from __future__ import annotations

from pathlib import Path

from shardwise.generation.speculation_options import SpeculationOptions


def check_draft_run(options: SpeculationOptions | None, run_dir: Path, model_cfg, context_len: int) -> None:
    """A draft must share the served run's tokenizer and vocabulary (its tokens are the target's),
    cover the served context, and the served model must be a decoder; one-line errors naming the flag."""
    from shardwise.config.loader import load_config
    from shardwise.core.run_files import step_dirs
    from shardwise.data.tokenizer import load_tokenizer
    from shardwise.models.families import spec_of

    if options is None:
        return
    if spec_of(model_cfg.family).encoder_decoder:
        raise ValueError(f"--speculate = {options_value(options)!r} is invalid for --run {str(run_dir)!r}, an "
                         "encoder-decoder (its prompt is the encoder's input, not a prefix to look up or draft); "
                         "leave --speculate out")
    if options.draft_run is None:
        return
    value = options_value(options)
    draft_dir = options.draft_run
    if not (draft_dir / "config.json").is_file() or not (draft_dir / "tokenizer.json").is_file():
        raise ValueError(f"--speculate = {value!r} is invalid: {str(draft_dir)!r} is not a run directory (no "
                         "config.json and tokenizer.json); name a run written by `shardwise train`")
    if not step_dirs(draft_dir):
        raise ValueError(f"--speculate = {value!r} is invalid: {str(draft_dir)!r} has no checkpoint yet; train it "
                         "(checkpoint.at_end = true) first")
    draft_cfg = load_config(draft_dir / "config.json").model
    if draft_cfg.vocab_size != model_cfg.vocab_size:
        raise ValueError(f"--speculate = {value!r} is invalid: the draft's vocabulary has {draft_cfg.vocab_size} "
                         f"tokens, the served run's {model_cfg.vocab_size}; use a draft trained with the same tokenizer")
    if load_tokenizer(draft_dir / "tokenizer.json").get_vocab() != load_tokenizer(run_dir / "tokenizer.json").get_vocab():
        raise ValueError(f"--speculate = {value!r} is invalid: the draft's tokenizer differs from the served run's; "
                         "use a draft trained with the same tokenizer (same data and data.vocab_size)")
    if draft_cfg.max_seq_len < context_len or spec_of(draft_cfg.family).encoder_decoder \
            or not spec_of(draft_cfg.family).generates_text:
        raise ValueError(f"--speculate = {value!r} is invalid: the draft must be a decoder whose max_seq_len "
                         f"({draft_cfg.max_seq_len}) covers the served context ({context_len}); lower --context-len "
                         "or use another draft")


def options_value(options: SpeculationOptions) -> str:
    return "ngram" if options.draft_run is None else f"draft:{options.draft_run}"
