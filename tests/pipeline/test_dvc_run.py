"""`moe repro`'s DVC (pipeline/dvc_run.py): DVC's bookkeeping lines and its error for a stage
stopped by Ctrl-C stay off the console; every other line passes."""

import logging

from pipeline.dvc_run import DropBookkeeping


def record(name: str, level: int, message: str, exc: BaseException | None = None) -> logging.LogRecord:
    return logging.LogRecord(name, level, "dvc.py", 1, message, (), (type(exc), exc, None) if exc else None)


def failed_stage(status: int) -> BaseException:
    try:
        try:
            raise RuntimeError(f"failed to run: sh scripts/moe train, exited with {status}")
        except RuntimeError as cmd:
            raise RuntimeError("failed to reproduce 'train'") from cmd
    except RuntimeError as exc:
        return exc


def test_bookkeeping_and_an_interrupted_stage_are_dropped_the_rest_passes():
    keep = DropBookkeeping().filter
    assert not keep(record("dvc.dvcfile", logging.INFO, "Updating lock file 'dvc.lock'"))
    assert not keep(record("dvc.repo.reproduce", logging.INFO, ""))
    assert not keep(record("dvc.stage.run", logging.INFO, "> sh scripts/moe train"))
    assert not keep(record("dvc.cli", logging.ERROR, "failed to reproduce 'train'", failed_stage(130)))
    assert keep(record("dvc.stage.run", logging.INFO, "Running stage 'train':"))
    assert keep(record("dvc.repo.reproduce", logging.INFO, "Stage 'tokenize' didn't change, skipping"))
    assert keep(record("dvc.dvcfile", logging.WARNING, "dvc.lock is in an old format"))
    assert keep(record("dvc.cli", logging.ERROR, "failed to reproduce 'train'", failed_stage(2)))
