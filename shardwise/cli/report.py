"""`shardwise report`: an HTML page of one or more runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.cli.flag_types import integer_at_least


def add_report_parser(sub) -> None:
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
    report.add_argument("--step", type=integer_at_least(0, "use a step number, 0 or more"),
                        help="the step of the pipeline timeline to draw (default: the last one recorded)")
    report.set_defaults(func=cmd_report)


def cmd_report(args: argparse.Namespace) -> None:
    from shardwise.observe.report import write_report

    page, pipeline_text = write_report([Path(d) for d in args.run_dir], out_dir=args.out and Path(args.out),
                                       step=args.step)
    if pipeline_text:
        print(pipeline_text)
    print(f"report: {page}")
