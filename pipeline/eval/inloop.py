"""The in-loop evaluation of a training job: its tasks tokenised and its validation batches
read on every training process, handed to the trainer as a callback (moe.eval.callback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moe.config import ExperimentConfig
from moe.eval.callback import EvalCallback
from pipeline.eval.requests import prepare_tasks
from pipeline.tokenizer import load_tokenizer


def eval_inputs(tokens_dir: str | Path, data_dir: str | None) -> dict[str, Any]:
    """What a job needs to evaluate in the loop (job.json): the tokenizer, the validation split, the task data."""
    tokens_dir = Path(tokens_dir)
    return {"tokenizer": str(tokens_dir / "tokenizer.json"), "val": str(tokens_dir / "val"), "data_dir": data_dir}


def prepare_in_loop(cfg: ExperimentConfig, inputs: dict[str, Any], key: str = "train.eval_tasks"):
    """The tokenised tasks (every check made: names, data, tokenizer, lengths)."""
    info = load_tokenizer(inputs["tokenizer"])
    return prepare_tasks(
        cfg.train.eval_tasks,
        info,
        limit=cfg.train.eval_limit,
        data_dir=inputs.get("data_dir"),
        key=key,
        max_len=cfg.model.max_seq_len,
        seed=cfg.train.eval_seed,
        truncation_mode=cfg.train.eval_truncation,
        truncation_key="train.eval_truncation",
    ), info


def build_eval_callback(cfg: ExperimentConfig, inputs: dict[str, Any]) -> EvalCallback:
    from moe.data import TokenDataset

    tasks, info = prepare_in_loop(cfg, inputs)
    val_batches = []
    if cfg.train.eval_val_batches and Path(inputs["val"]).is_dir():
        val = TokenDataset([inputs["val"]], cfg.data.seq_len, tokenizer_hash=cfg.data.tokenizer_hash)
        micro = cfg.train.micro_batch_size
        n = min(len(val), cfg.train.eval_val_batches * micro)
        index = np.arange(n)
        val_batches = [val.batch(index[i : i + micro]) for i in range(0, n, micro)]
    pad = info.pad_id if info.pad_id is not None else info.eos_id
    return EvalCallback(
        cfg.train.eval_every,
        tasks,
        val_batches,
        max_len=cfg.model.max_seq_len,
        batch_tokens=cfg.train.eval_batch_tokens,
        pad_id=pad,
        final_step=cfg.train.max_steps,
    )
