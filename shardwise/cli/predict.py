"""`shardwise predict`: an encoder run's masks (BERT), spans (T5) or image classes (ViT)."""

from __future__ import annotations

import argparse

from shardwise.cli.flag_types import integer_at_least


def add_predict_parser(sub) -> None:
    pred = sub.add_parser("predict", help="fill masks (BERT) or spans (T5), or classify the held-out images (ViT), with a trained run",
                          description="Use a trained encoder run's newest checkpoint (of any layout) in one process: "
                                      "a BERT run fills each <mask> of --text, a T5 run each <extra_id_N> span, a ViT run "
                                      "classifies its held-out images.")
    pred.add_argument("--run", required=True, help="run directory written by `shardwise train`")
    pred.add_argument("--text", help="BERT: text with one or more <mask> to fill in; T5: text with <extra_id_0>, "
                                     "<extra_id_1>, ... spans to fill in")
    pred.add_argument("--max-new-tokens", type=integer_at_least(1, "ask for at least 1 token"), default=32, help="T5: decoder tokens at most (default: %(default)s)")
    pred.add_argument("--top-k", type=integer_at_least(1, "use 1 or more"), default=5, help="BERT: candidates shown per mask (default: %(default)s)")
    pred.add_argument("--show", type=integer_at_least(1, "list at least 1 prediction"), default=10, help="ViT: predictions listed (default: %(default)s)")
    pred.add_argument("--checkpoint", help="a checkpoint directory of the run (default: the newest)")
    pred.set_defaults(func=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> None:
    from shardwise.infer.predict import predict_text

    print(predict_text(args))
