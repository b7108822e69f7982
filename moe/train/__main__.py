"""Run one training job from a JSON config: ``python -m moe.train run.json [--set k=v ...]``.

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
from moe.errors import EXIT_CODES, exit_code_of
from moe.parallel.env import shutdown_distributed
from moe.train.determinism import set_environment
from moe.train.sinks import ConsoleSink, JsonlSink
from moe.train.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe.train", description=__doc__)
    parser.add_argument("config", type=Path, help="JSON file with the library's config sections")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--metrics-jsonl", type=Path, help="append per-step metrics here (rank 0)")
    parser.add_argument("--summary-json", type=Path, help="write the run summary here (rank 0)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    clean = False  # collective teardown only after a run every rank finished
    try:
        data = json.loads(args.config.read_text())
        cfg = ExperimentConfig.load(data, args.overrides)
        if cfg.train.deterministic:  # before anything starts CUDA or NCCL
            set_environment()
        sinks = [ConsoleSink()]
        if args.metrics_jsonl:
            sinks.append(JsonlSink(args.metrics_jsonl))
        trainer = Trainer(cfg, sinks=sinks)
        summary = trainer.fit()
        if args.summary_json and trainer.env.is_main:
            args.summary_json.parent.mkdir(parents=True, exist_ok=True)
            args.summary_json.write_text(json.dumps(summary.__dict__, indent=2, default=str))
        clean = True
        return 0
    except json.JSONDecodeError as exc:
        print(f"error: {args.config}: not valid JSON ({exc})", file=sys.stderr)
        return EXIT_CODES["bad_input"]
    except Exception as exc:
        code = exit_code_of(exc)
        if code is None:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return code
    finally:
        shutdown_distributed(clean=clean)


if __name__ == "__main__":
    sys.exit(main())
