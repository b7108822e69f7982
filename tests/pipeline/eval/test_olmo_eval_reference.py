"""Our downstream evaluation against ai2-olmo-eval's own code, in its own environment.

The reference environment (requirements/olmo-eval-reference.lock: ai2-olmo-eval 0.9.0 with its
pins, and torch) is built once under .venv-olmo-eval/. There, ai2-olmo-eval's task classes
build and collate the requests and its ICLMetric computes the metrics, on our checkpoint's
logits (tests/pipeline/eval/olmo_eval_reference.py). Here, pipeline/eval builds the same tasks
and moe/eval scores them. They must agree: the same (doc, continuation) pairs with the same
token ids, per-request log-likelihoods within 1e-5 relative, every metric within 1e-5.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.workspace import REPO

pytestmark = pytest.mark.slow

# every family: the in-loop suite (zero-shot), MMLU's formulations, OLMES rc/mc/bpb requests
LABELS = [
    "arc_easy",
    "arc_challenge",
    "hellaswag",
    "piqa",
    "winogrande",
    "boolq",
    "sciq",
    "openbook_qa",
    "social_iqa",
    "commonsense_qa",
    "copa",
    "mmlu_stem",
    "mmlu_humanities_mc_5shot",
    "mmlu_other_var",
    "mmlu_social_sciences_bpb",
    "arc_easy_rc_5shot",
    "arc_challenge_mc_5shot",
    "hellaswag_rc_5shot",
    "piqa_rc_0shot",
    "winogrande_rc_5shot",
    "csqa_rc_5shot",
    "boolq_mc_5shot",
    "hellaswag_bpb_5shot",
]
LIMIT = 12  # documents of each task (a seeded sample: the reference scores the same ones)


def test_ours_equal_ai2_olmo_eval(reference_python, trained_dir, tmp_path):
    from moe.eval.suite import evaluate_suite
    from moe.train.weights import load_model
    from pipeline.eval.requests import prepare_tasks
    from pipeline.tokenizer import load_tokenizer

    ckpt, tok_file = trained_dir / "runs/train/checkpoints", trained_dir / "data/tokens/tokenizer.json"
    info = load_tokenizer(tok_file)
    model = load_model(ckpt, torch.device("cpu"))
    max_len = model.cfg.max_seq_len
    tasks = prepare_tasks(LABELS, info, limit=LIMIT, data_dir=None, key="test", max_len=max_len)
    ours, scores = evaluate_suite(lambda x: model(x), tasks, max_len=max_len, device=torch.device("cpu"), pad_id=info.pad_id)

    spec = {
        "checkpoint": str(ckpt),
        "tokenizer": str(tok_file),
        "eos_id": info.eos_id,
        "pad_id": info.pad_id,
        "max_len": max_len,
        "labels": LABELS,
        # the documents our seeded sample chose (evaluate.limit is a sample, not a prefix)
        "doc_ids": {t.name: sorted({q.doc_id for q in t.requests}) for t in tasks},
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [str(reference_python), str(Path(__file__).with_name("olmo_eval_reference.py")), str(tmp_path / "spec.json"), str(tmp_path / "ref.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=3000,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads((tmp_path / "ref.json").read_text())

    for t in tasks:
        theirs = ref[t.name]
        assert theirs["metric_type"] == t.metric, t.name
        mine = {(q.doc_id, q.cont_id): (i, q) for i, q in enumerate(t.requests)}
        assert len(mine) == len(theirs["samples"]), t.name
        for sample, score in zip(theirs["samples"], theirs["scores"], strict=True):
            i, q = mine[(sample["doc_id"], sample["cont_id"])]
            assert (list(q.ctx), list(q.cont), q.label) == (sample["ctx"], sample["continuation"], sample["label"]), t.name
            assert (q.cont_chars, q.cont_bytes) == (sample["cont_str_len"], sample["cont_byte_len"]), t.name
            assert scores[t.name][i] == pytest.approx(score, rel=1e-5, abs=1e-5), (t.name, sample["doc_id"])
        for metric_type, values in theirs["metrics"].items():
            for key, value in values.items():
                if key.startswith("soft") and metric_type != t.metric:
                    continue  # soft scores are reported for the task's own metric type
                assert ours[t.name][key] == pytest.approx(value, rel=1e-5, abs=1e-5), (t.name, metric_type, key)
