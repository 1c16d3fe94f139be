"""The `shardwise` command: train, generate, serve, report, checkpoints, convert, rules, estimate, plan, calibrate.

Each subcommand validates everything it was given before doing any work; a bad value ends
with one line on stderr (`shardwise: error: ...`) and exit status 2 (set SHARDWISE_DEBUG=1
for the traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from shardwise.core import exit_status

PLANNER_COMMANDS = ("estimate", "plan", "calibrate")
"""Subcommands that run without torch: their parser is built without the config (which imports it)."""


def cmd_train(args: argparse.Namespace) -> None:
    from shardwise.config.loader import config_from_args
    from shardwise.runtime.launch import already_launched, config_argv, launch_local, resolve_nproc

    nproc = resolve_nproc(args.nproc)
    cfg = config_from_args(args)  # validated once, here, before any worker starts
    if not already_launched():
        from shardwise.distributed.dims import ParallelDims
        from shardwise.train.auto_layout import resolve_parallel
        from shardwise.runtime.process_group import resolve_device

        planned = resolve_parallel(cfg, nproc, device_type=resolve_device(cfg.train.device).type, announce=False)
        ParallelDims.from_config(planned.parallel, nproc).check(planned)  # the layout against model and batch
    if nproc > 1 and not already_launched():
        from shardwise.train.preflight import check_before_launch

        check_before_launch(cfg)  # data, tokenizer, checkpoint shape: here, not as N ranks' errors
        sys.exit(launch_local(nproc, config_argv(args), max_restarts=cfg.train.max_restarts, run_dir=Path(cfg.run.dir),
                              stop_signals=cfg.train.preempt_signals, stall_timeout_s=cfg.train.stall_timeout_s))
    from shardwise.train.trainer import train

    result = train(cfg)
    losses = result.losses
    if losses and os.environ.get("RANK", "0") == "0":
        validation = f", val_loss {result.val_losses[max(result.val_losses)]:.4f}" if result.val_losses else ""
        print(f"trained steps {result.first_step}..{result.first_step + len(losses) - 1}: "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}{validation} in {result.wall_time_s:.1f}s; "
              f"run dir {result.run_dir}")


def launched_again(args: argparse.Namespace, flags: tuple[str, ...]) -> bool:
    """`generate`/`serve --nproc N` (N > 1): start N ranks running this command, tensor-parallel over all
    of them; False when this process is to do the work itself (one process, or a rank already)."""
    from shardwise.runtime.launch import already_launched, launch_local, resolve_nproc

    nproc = resolve_nproc(args.nproc)
    if args.tp != nproc:
        raise ValueError(f"--parallel.tp = {args.tp} is invalid: {args.command} splits the model over all "
                         f"--nproc {nproc} processes; use the same number for both")
    if nproc == 1 or already_launched():
        return False
    sys.exit(launch_local(nproc, [*rank_argv(args, flags), f"--nproc={nproc}", f"--parallel.tp={args.tp}"],
                          module="shardwise.infer"))


def rank_argv(args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    """The command line that gives a rank the same `flags` (those given, and defaults: flags left unset
    are None or False, so mutually exclusive ones are never passed together)."""
    argv = [args.command]
    for flag in flags:
        value = getattr(args, flag)
        if value is True:
            argv.append(f"--{flag.replace('_', '-')}")
        elif value is not None and value is not False:
            argv.append(f"--{flag.replace('_', '-')}={value}")
    return argv


GENERATE_FLAGS = ("run", "prompt", "prompts_file", "json", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                  "max_batch", "checkpoint", "device")
SERVE_FLAGS = ("run", "host", "port", "api_key", "model_name", "max_batch", "max_queue", "prefill_chunk",
               "context_len", "compile", "checkpoint", "device")


def cmd_generate(args: argparse.Namespace) -> None:
    from shardwise.infer.commands import generate_text, read_prompts, sampling_of

    sampling_of(args)  # every flag checked here, before any rank starts
    read_prompts(args)
    check_at_least_one(args, ("max_batch",))
    if not launched_again(args, GENERATE_FLAGS):
        text = generate_text(args)
        if os.environ.get("RANK", "0") == "0":
            print(text)


def cmd_predict(args: argparse.Namespace) -> None:
    from shardwise.infer.predict import predict_text

    if args.top_k < 1:
        raise ValueError(f"--top-k = {args.top_k} is invalid: use 1 or more")
    print(predict_text(args))


def check_at_least_one(args: argparse.Namespace, flags: tuple[str, ...]) -> None:
    for flag in flags:
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} = {getattr(args, flag)} is invalid: use 1 or more")


def cmd_serve(args: argparse.Namespace) -> None:
    from shardwise.infer.commands import serve

    check_at_least_one(args, ("max_batch", "max_queue", "prefill_chunk"))
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port = {args.port} is invalid: use a TCP port from 0 to 65535")
    if not launched_again(args, SERVE_FLAGS):
        serve(args)


def cmd_convert(args: argparse.Namespace) -> None:
    from shardwise.convert import export_run_to_hf, import_hf_to_run

    if args.from_hf:
        out = import_hf_to_run(Path(args.from_hf), Path(args.out), tokenizer=args.tokenizer and Path(args.tokenizer))
        print(f"imported {args.from_hf} -> run dir {out} (generate with: shardwise generate --run {out})")
    else:
        out = export_run_to_hf(Path(args.to_hf), Path(args.out), arch=args.arch,
                               checkpoint=args.checkpoint and Path(args.checkpoint))
        print(f"exported {args.to_hf} -> Hugging Face checkpoint {out}")


def cmd_report(args: argparse.Namespace) -> None:
    from shardwise.observe.report import write_report

    page, pipeline_text = write_report([Path(d) for d in args.run_dir], out_dir=args.out and Path(args.out),
                                       step=args.step)
    if pipeline_text:
        print(pipeline_text)
    print(f"report: {page}")


def cmd_checkpoints(args: argparse.Namespace) -> None:
    from shardwise.checkpoint.store import step_dirs
    from shardwise.checkpoint.integrity import checkpoints_table

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"RUN_DIR = {run_dir} is not a directory: give the run.dir of a `shardwise train` run")
    print(checkpoints_table(run_dir, step_dirs(run_dir)))


def cmd_rules(args: argparse.Namespace) -> None:
    from shardwise.compile.rules.report import rules_report
    from shardwise.config.loader import config_from_args

    cfg = config_from_args(args)
    print(rules_report(cfg))
    if args.memory:
        from shardwise.observe.block_memory import memory_report

        print("\n" + memory_report(cfg.model))


def add_planner_commands(sub) -> None:
    from shardwise.cli.plan_commands import add_calibrate_parser, add_estimate_parser, add_plan_parser

    add_estimate_parser(sub)
    add_plan_parser(sub)
    add_calibrate_parser(sub)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What generate and serve share: which checkpoint, which device, how many processes."""
    parser.add_argument("--checkpoint", help="a checkpoint directory of the run (default: the newest)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ... (default: %(default)s)")
    parser.add_argument("--nproc", default="1", metavar="N", help="processes to split the model over (default: 1)")
    parser.add_argument("--parallel.tp", dest="tp", type=int, default=1,
                        help="tensor-parallel degree; must equal --nproc (default: 1)")


class OneLineErrors(argparse.ArgumentParser):
    """argparse's own errors (an unknown flag, a value of the wrong type) in the one-line form of all others."""

    def error(self, message: str):
        self.exit(exit_status.BAD_INPUT, f"shardwise: error: {message} (see: {self.prog} --help)\n")


def build_planner_parser() -> argparse.ArgumentParser:
    """Only the planner's subcommands: `shardwise estimate --jsonl` starts without importing torch."""
    parser = OneLineErrors(prog="shardwise", description=__doc__.splitlines()[0])
    add_planner_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def build_parser() -> argparse.ArgumentParser:
    from shardwise.config.loader import add_config_arguments

    parser = OneLineErrors(prog="shardwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (no arguments: the built-in demo on 2 CPU processes)",
                           description="Train a model. With no arguments, trains the built-in demo, "
                                       "data-parallel over 2 processes on CPU (one per accelerator otherwise).")
    train.add_argument("--nproc", default="auto", metavar="N",
                       help="training processes on this machine: auto (one per accelerator; 2 on CPU) or a count "
                            "(default: %(default)s). Many machines: torchrun ... -m shardwise.train, see examples/README.md")
    add_config_arguments(train)
    train.set_defaults(func=cmd_train)

    pred = sub.add_parser("predict", help="fill masks (BERT) or spans (T5), or classify the held-out images (ViT), with a trained run",
                          description="Use a trained encoder run's newest checkpoint (of any layout) in one process: "
                                      "a BERT run fills each <mask> of --text, a T5 run each <extra_id_N> span, a ViT run "
                                      "classifies its held-out images.")
    pred.add_argument("--run", required=True, help="run directory written by `shardwise train`")
    pred.add_argument("--text", help="BERT: text with one or more <mask> to fill in; T5: text with <extra_id_0>, "
                                     "<extra_id_1>, ... spans to fill in")
    pred.add_argument("--max-new-tokens", type=int, default=32, help="T5: decoder tokens at most (default: %(default)s)")
    pred.add_argument("--top-k", type=int, default=5, help="BERT: candidates shown per mask (default: %(default)s)")
    pred.add_argument("--show", type=int, default=10, help="ViT: predictions listed (default: %(default)s)")
    pred.add_argument("--checkpoint", help="a checkpoint directory of the run (default: the newest)")
    pred.set_defaults(func=cmd_predict)
    gen = sub.add_parser("generate", help="generate text from a trained run (several prompts batched)",
                         description="Continue one prompt, or every prompt of a file at once (continuous batching), "
                                     "with a trained run's newest checkpoint of any layout.")
    gen.add_argument("--run", required=True, help="run directory written by `shardwise train`")
    prompts = gen.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", help="text to continue (default: 'def ')")
    prompts.add_argument("--prompts-file", metavar="FILE",
                         help="one prompt per line, or a .jsonl file of strings or {\"prompt\": ...} objects")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (prompt, completion, finish_reason, token counts)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.8,
                     help="sampling temperature from 0 (greedy) to 2 (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=50,
                     help="sample from the k most likely tokens; 0 = all (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="sample from the smallest set of tokens whose probability reaches p (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    gen.add_argument("--max-batch", type=int, default=16, help="prompts generated at once (default: %(default)s)")
    add_run_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve a trained run over an OpenAI-compatible HTTP API",
                         description="Serve a run's newest checkpoint (any training layout) at /v1/completions, "
                                     "/v1/chat/completions and /v1/models, with /health and /metrics; continuous "
                                     "batching over --max-batch slots. See docs/serving.md.")
    srv.add_argument("--run", required=True, help="run directory written by `shardwise train` (or convert --from-hf)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $SHARDWISE_API_KEY, else none)")
    srv.add_argument("--model-name", help="the model id clients name (default: the run's run.name)")
    srv.add_argument("--max-batch", type=int, default=16,
                     help="sequences decoded together, each holding a KV-cache slot (default: %(default)s)")
    srv.add_argument("--max-queue", type=int, default=256,
                     help="sequences that may wait for a slot; beyond it requests get 429 (default: %(default)s)")
    srv.add_argument("--prefill-chunk", type=int, default=256,
                     help="prompt tokens prefilled per engine step, so long prompts do not stall decoding "
                          "(default: %(default)s)")
    srv.add_argument("--context-len", type=int,
                     help="tokens per sequence, prompt and output (default: the model's max_seq_len)")
    srv.add_argument("--compile", action="store_true", help="compile the decode step with torch.compile "
                                                            "(CUDA graphs on GPU)")
    add_run_arguments(srv)
    srv.set_defaults(func=cmd_serve)

    report = sub.add_parser("report", help="an HTML page of one or more runs' curves, memory, communication "
                                           "and pipeline timeline",
                            description="Write report.html (in the first RUN_DIR, or --out) with PNG figures beside "
                                        "it: loss and validation loss, learning rate, gradient norm, tokens/s, MFU, "
                                        "memory per rank against the ZeRO formula, collective bytes per step and, "
                                        "for runs with parallel.pp > 1, the pipeline timeline (also drawn as "
                                        "RUN_DIR/pipeline.png, its bubble printed for the first run). Several "
                                        "runs are overlaid, one colour each. The page works offline and can be "
                                        "copied with its folder.")
    report.add_argument("run_dir", metavar="RUN_DIR", nargs="+", help="run directories written by `shardwise train`")
    report.add_argument("--out", metavar="DIR",
                        help="directory for report.html and its PNGs (default: the first RUN_DIR)")
    report.add_argument("--step", type=int,
                        help="the step of the pipeline timeline to draw (default: the last one recorded)")
    report.set_defaults(func=cmd_report)

    ckpts = sub.add_parser("checkpoints", help="a run's checkpoints with their step and status (ok/corrupt/incomplete)",
                           description="List RUN_DIR's checkpoints, oldest first, each checked against its "
                                       "manifest (every file's size and SHA-256): ok, incomplete (save not "
                                       "finished, or a file missing) or corrupt; and the one a resume would load.")
    ckpts.add_argument("run_dir", metavar="RUN_DIR", help="run directory written by `shardwise train`")
    ckpts.set_defaults(func=cmd_checkpoints)

    conv = sub.add_parser("convert", help="convert between a run directory and a Hugging Face checkpoint")
    direction = conv.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="HF_DIR",
                           help="import a transformers checkpoint (Llama/Mistral/Qwen2/3/Mixtral, GPT-2, BERT masked LM, "
                                "ViT image classifier)")
    direction.add_argument("--to-hf", metavar="RUN_DIR", help="export a run's checkpoint as a transformers checkpoint")
    conv.add_argument("--out", required=True, help="the directory to write")
    conv.add_argument("--arch", default=None,
                      help="architecture written by --to-hf: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, ... for "
                           "the llama family; gpt2, bert, vit for theirs (the family's converter checks it) "
                           "(default: the run's family: llama, gpt2, bert or vit)")
    conv.add_argument("--checkpoint", help="with --to-hf: a checkpoint directory (default: the newest)")
    conv.add_argument("--tokenizer", help="with --from-hf: tokenizer.json to use (default: the one in HF_DIR)")
    conv.set_defaults(func=cmd_convert)
    rules = sub.add_parser("rules", help="the compiler's rewrite rules and how often each fires on the model",
                           description="List every rewrite rule (shardwise/compile/rules/) and how many times it "
                                       "matches each kind of block of the configured model (traced on a narrowed "
                                       "copy of the block; nothing is compiled).")
    rules.add_argument("--memory", action="store_true",
                       help="also compile one block (scaled down, proportions kept) eager, compiled and compiled with "
                            "the rules, and print what each keeps for backward per token, in bf16")
    add_config_arguments(rules)
    rules.set_defaults(func=cmd_rules)
    add_planner_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_planner_parser() if words[:1] and words[0] in PLANNER_COMMANDS else build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        if os.environ.get("SHARDWISE_DEBUG"):
            raise
        report(f"shardwise: error: {err}")
        raise SystemExit(exit_status.BAD_INPUT) from None
    except FloatingPointError as err:  # the trainer's NonfiniteLoss: the run diverged, not bad input
        if os.environ.get("SHARDWISE_DEBUG"):
            raise
        report(f"shardwise: error: {err}", rank_zero_only=True)
        return exit_status.NONFINITE
    except Exception as err:
        preemption = sys.modules.get("shardwise.runtime.preemption")  # loaded by training only (it imports torch)
        if preemption is None:
            raise
        if isinstance(err, preemption.Preempted):  # raised by every rank alike, after the save
            report(f"shardwise: {err}", rank_zero_only=True)
            return exit_status.PREEMPTED
        if preemption.stopped_by_launcher(err):  # a peer died and the launcher is stopping us: it reports
            preemption.exit_quietly()
        raise
    return 0


def report(line: str, *, rank_zero_only: bool = False) -> None:
    """Print a one-line outcome on stderr; a rank started by `shardwise train --nproc` hands it to the
    launcher instead, which prints the first failed rank's line once."""
    rank = os.environ.get("RANK", "0")
    if "WORLD_SIZE" in os.environ:  # a rank: torch is loaded already
        from shardwise.runtime.launch import MESSAGE_DIR_ENV

        if os.environ.get(MESSAGE_DIR_ENV):
            (Path(os.environ[MESSAGE_DIR_ENV]) / f"rank{rank}.txt").write_text(line)
            return
    if rank == "0" or not rank_zero_only:
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
