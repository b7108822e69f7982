"""The in-loop evaluation of a training job: its tasks tokenised once, where the job is checked,
and written at launch as a requests file (moe.eval.requests) that every training process reads
(moe.train.callbacks.in_loop_eval); its validation batches read from the tokenise stage's split."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moe.config import ExperimentConfig
from moe.eval.requests import dump_task_requests, is_requests_file
from pipeline.eval.requests import prepare_tasks
from pipeline.tokenizer import load_tokenizer

REQUESTS_FILE = "eval_requests.json.gz"  # in the run directory, beside job.json


def eval_inputs(requests: str | Path, tokens_dir: str | Path) -> dict[str, Any]:
    """What a job needs to evaluate in the loop (job.json): its tokenised tasks, the validation split."""
    return {"requests": str(requests), "val": str(Path(tokens_dir) / "val")}


def tokenise_in_loop(exp: ExperimentConfig, tokens_dir: str | Path, data_dir: str | None) -> bytes:
    """``train.eval_tasks`` tokenised with the tokenise stage's tokenizer, every check made (names,
    data, tokenizer, lengths): the requests file's content, with what it was tokenised for."""
    ev = exp.train.in_loop_eval
    info = load_tokenizer(Path(tokens_dir) / "tokenizer.json")
    tasks = prepare_tasks(
        ev.tasks,
        info,
        limit=ev.limit,
        data_dir=data_dir,
        key="train.eval_tasks",
        max_len=exp.model.max_seq_len,
        seed=ev.seed,
        truncation_mode=ev.truncation,
        truncation_key="train.eval_truncation",
    )
    pad = info.pad_id if info.pad_id is not None else info.eos_id
    meta = {
        "tokenizer_sha256": info.sha256,
        "vocab_size": info.vocab_size,
        "pad_id": pad,
        "max_len": exp.model.max_seq_len,
        "limit": ev.limit,
        "seed": ev.seed,
        "task_names": list(ev.tasks),
        "truncation": ev.truncation,
    }
    return dump_task_requests(tasks, meta)


def write_in_loop_requests(path: str | Path, content: bytes) -> Path:
    """The tokenised tasks where the job's processes read them (never over a file not ours)."""
    from pipeline.outputs import write_output_file

    return write_output_file(path, content, "train.eval_tasks", recognise=is_requests_file)
