"""Run one training job from a JSON config: ``python -m moe.train run.json [--set k=v ...]``.

``train.eval_every`` evaluates in the loop as the pipeline does: the tasks come tokenised
(``--eval-requests``, what `moe tasks --export` writes, for the config's eval_tasks, eval_limit
and eval_seed), the validation loss from the token files of ``--eval-val``.

The entry point every executor launches (one process, N local processes, Slurm tasks);
torch.distributed is joined from the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).
Exit codes: 0 done, 2 bad config or data, 3 non-finite loss, 4 checkpoint problem.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from moe.config import ExperimentConfig
from moe.errors import ConfigError, error_line
from moe.reader import MIB, Map, Plain, Str, read_json
from moe.train.process import run_process, train
from moe.train.sinks import ConsoleSink, JsonlSink, check_output_target, write_file_atomic

MAX_CONFIG_BYTES = 16 * MIB  # a run's config is a few kB; data.paths may list many thousands of files
# A mapping of config sections, each plain bounded JSON: ExperimentConfig.load checks every key next.
CONFIG_FILE_SCHEMA = Map(other=Plain(), keys=Str(64, r"[a-z_]+"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe.train", description=__doc__)
    parser.add_argument("config", type=Path, help="JSON file with the library's config sections")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--metrics-jsonl", type=Path, help="append per-step metrics here (rank 0)")
    parser.add_argument("--summary-json", type=Path, help="write the run summary here (rank 0)")
    parser.add_argument("--eval-requests", type=Path, help="train.eval_tasks tokenised (`moe tasks --export`)")
    parser.add_argument("--eval-val", type=Path, help="token files of the validation split (train.eval_val_batches)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    def body() -> None:
        cfg = ExperimentConfig.load(read_json(args.config, CONFIG_FILE_SCHEMA, MAX_CONFIG_BYTES), args.overrides)
        check_outputs(args)
        sinks = [ConsoleSink()] + ([JsonlSink(args.metrics_jsonl)] if args.metrics_jsonl else [])
        trainer, summary = train(cfg, sinks, in_loop_eval(cfg, args))
        if args.summary_json and trainer.env.is_main:
            write_file_atomic(args.summary_json, json.dumps(summary.__dict__, indent=2, default=str))

    code, _, message = run_process(body)
    if message is not None:
        print(error_line(message), file=sys.stderr)
    return code


def in_loop_eval(cfg: ExperimentConfig, args: argparse.Namespace) -> list:
    """The in-loop evaluation the config asks for (none: train.eval_every 0), from the flags'
    files; a flag without a use, or tasks without their file, is one error."""
    ev = cfg.train.in_loop_eval
    if not ev.every:
        flag = "--eval-requests" if args.eval_requests else "--eval-val" if args.eval_val else None
        if flag:
            raise ConfigError(f"{flag}: train.eval_every is 0 (no in-loop evaluation)")
        return []
    if ev.tasks and args.eval_requests is None:
        raise ConfigError(
            "train.eval_tasks: pass them tokenised with --eval-requests FILE (`moe tasks --export FILE --tokenizer ... --task ...` writes one)"
        )
    if args.eval_requests is not None and not ev.tasks:
        raise ConfigError("--eval-requests: train.eval_tasks is empty (name the tasks the file holds)")
    from moe.train.callbacks.in_loop_eval import in_loop_eval_callback

    return [in_loop_eval_callback(cfg, args.eval_requests, args.eval_val)]


def check_outputs(args: argparse.Namespace) -> None:
    """The files the caller names are checked before any training: a symlink or a directory
    there is refused now, not after the run (which would leave checkpoints and no summary)."""
    for flag, path in (("--summary-json", args.summary_json), ("--metrics-jsonl", args.metrics_jsonl)):
        if path is not None:
            check_output_target(path, flag)


if __name__ == "__main__":
    sys.exit(main())
