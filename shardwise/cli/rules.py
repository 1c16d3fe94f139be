"""`shardwise rules`: the compiler's rewrite rules and how often each fires on the configured model."""

from __future__ import annotations

import argparse


def add_rules_parser(sub) -> None:
    from shardwise.config.loader import add_config_arguments

    rules = sub.add_parser("rules", help="the compiler's rewrite rules and how often each fires on the model",
                           description="List every rewrite rule (shardwise/compile/rules/) and how many times it "
                                       "matches each kind of block of the configured model (traced on a narrowed "
                                       "copy of the block; nothing is compiled).")
    rules.add_argument("--memory", action="store_true",
                       help="also compile one block (scaled down, proportions kept) eager, compiled and compiled with "
                            "the rules, and print what each keeps for backward per token, in bf16")
    add_config_arguments(rules)
    rules.set_defaults(func=cmd_rules)


def cmd_rules(args: argparse.Namespace) -> None:
    from shardwise.compile.rules.report import rules_report
    from shardwise.config.loader import config_from_args

    cfg = config_from_args(args)
    print(rules_report(cfg))
    if args.memory:
        from shardwise.observe.block_memory import memory_report

        print("\n" + memory_report(cfg.model))
