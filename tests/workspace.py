"""A pipeline working directory for tests: the tiny params, a small corpus, a params loader."""

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TINY_PARAMS = {
    "tokenize": {"inputs": ["corpus"], "vocab_size": 300, "max_bytes": None, "workers": 1, "val_fraction": 0.2},
    "model": {"preset": "tiny", "vocab_size": 320, "d_model": 32, "n_heads": 2, "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 16}},
    "optim": {"lr": 0.003},
    "schedule": {"warmup_steps": 2},
    "data": {"seq_len": 32},
    "train": {
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "max_steps": 8,
        "log_every": 4,
        "eval_every": 4,
        "eval_tasks": ["arc_easy"],
        "eval_limit": 4,
        "eval_val_batches": 2,
    },
    "checkpoint": {"dir": "runs/train/checkpoints", "every": 4},
    "executor": {"run_dir": "runs/train"},
    "evaluate": {"batch_size": 2, "max_batches": 2, "generate_tokens": 6, "tasks": ["arc_easy", "winogrande", "mmlu_stem_mc_5shot"], "limit": 8},
}


def write_corpus(directory: Path, docs: int = 60) -> None:
    """A small jsonl corpus of pseudo-English."""
    import random

    rnd = random.Random(0)
    words = [
        "the",
        "expert",
        "router",
        "sends",
        "each",
        "token",
        "to",
        "a",
        "few",
        "experts",
        "and",
        "the",
        "layer",
        "adds",
        "their",
        "outputs",
        "weighted",
        "by",
        "the",
        "scores",
    ]
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "docs.jsonl", "w") as f:
        for _ in range(docs):
            text = " ".join(rnd.choice(words) for _ in range(rnd.randint(40, 120)))
            f.write(json.dumps({"text": text.capitalize() + "."}) + "\n")


def load(overrides=()):
    from pipeline.params import load_params

    return load_params(Path("params.yaml"), list(overrides))
