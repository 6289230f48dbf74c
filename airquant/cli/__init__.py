"""``airquant`` command line: ``build_parser`` and ``main``; each command lives in the module of its group.

- ``flags``: flag groups shared by several commands (engine, generation, KV cache, routing) and the configs
  they map to
- ``store_cmds``: shard, info, synth (write a store, or read what one holds)
- ``run_cmds``: plan, generate, batch, serve, ui (route and run a store)
- ``eval_cmds``: eval, report, env, pipeline (measure and report)
- ``doctor_cmds``: doctor (what this runtime gives AirQuant, and what AirQuant does with it)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from airquant import __version__
from airquant.cli import doctor_cmds, eval_cmds, run_cmds, store_cmds
from airquant.cli.flags import gpu_only_note
from airquant.errors import AirQuantError

__all__ = ["build_parser", "main"]

DESCRIPTION = """\
AirQuant runs LLMs larger than GPU memory: a one-time split into one shard per layer, then a
forward pass that streams each layer to the GPU only while it runs.

  airquant shard default --store ./store/default-bf16   split the embedded SmolLM2-135M model
  airquant generate ./store/default-bf16 --chat --prompt "What is the capital of France?"
  airquant info ./store/default-bf16 --verify          what a store holds; check every checksum
"""

# The order of ``airquant --help``.
COMMANDS = (store_cmds.add_shard_parser, store_cmds.add_info_parser, run_cmds.add_plan_parser,
            run_cmds.add_generate_parser, store_cmds.add_synth_parser, run_cmds.add_batch_parser,
            run_cmds.add_serve_parser, run_cmds.add_ui_parser, eval_cmds.add_eval_parser,
            eval_cmds.add_report_parser, eval_cmds.add_env_parser, eval_cmds.add_pipeline_parser,
            doctor_cmds.add_doctor_parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="airquant", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"airquant {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    parser.add_argument("-q", "--quiet", dest="quiet_all", action="store_true",
                        help="no progress bars (shard, eval, batch, pipeline); results and errors still print")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in COMMANDS:
        add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.quiet_all:
        os.environ["TQDM_DISABLE"] = "1"  # tqdm's own switch: bars built with its defaults obey it too
        if hasattr(args, "quiet"):  # a command's own --quiet (shard, synth, pipeline)
            args.quiet = True
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    note = gpu_only_note(args, planning=args.command in ("plan", "doctor"))
    if note:
        print(f"airquant: {note}", file=sys.stderr)
    try:
        return args.func(args)
    except AirQuantError as exc:
        print(f"airquant: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("airquant: interrupted; stores and output files keep what was finished.", file=sys.stderr)
        return 130
