"""Run inside the ai2-olmo-eval reference environment (its own venv: its pins clash with ours):
ai2-olmo-eval's own task classes and ICLMetric, on a checkpoint of ours.

    python olmo_eval_reference.py SPEC.json OUT.json

SPEC: {"checkpoint": dir, "tokenizer": tokenizer.json, "eos_id": n, "pad_id": n, "max_len": n,
       "labels": [...], "doc_ids": {label: [doc ids]}}. The model is the moe library's (torch only, on PYTHONPATH),
so the logits are the same function of the same token ids; everything about the tasks
(prompts, tokenisation, batching, metric arithmetic) is ai2-olmo-eval's. OUT: per label, the
samples (doc_id, cont_id, ctx, continuation, label) of the documents ``doc_ids`` names, their
summed log-likelihoods, and ICLMetric's results for acc, len_norm (ranked tasks) or the task's
own metric type.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from olmo_eval.metrics import ICLMetric  # noqa: E402
from olmo_eval.tasks import build_task  # noqa: E402
from olmo_eval.tokenizer import HFTokenizer  # noqa: E402

from moe.train.weights import load_model  # noqa: E402


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    tokenizer = HFTokenizer(spec["tokenizer"], pad_token_id=spec["pad_id"], eos_token_id=spec["eos_id"])
    model = load_model(spec["checkpoint"], torch.device("cpu"))
    out = {}
    for label in spec["labels"]:
        task = build_task(label, tokenizer, model_ctx_len=spec["max_len"])
        chosen = set(spec["doc_ids"][label])
        keep = [s for s in task.samples if s["doc_id"] in chosen]
        types = ["acc", "len_norm"] if task.metric_type in ("acc", "len_norm") else [task.metric_type]
        metrics = {t: ICLMetric(metric_type=t) for t in types}
        scores = []
        for i in range(0, len(keep), 8):
            batch = task.collate_fn(keep[i : i + 8])
            with torch.no_grad():
                logits = model(batch["input_ids"]).float()
            for m in metrics.values():
                m.update(batch, logits)
            for j in range(len(batch["doc_id"])):
                ctx_len, cont_len = int(batch["ctx_len"][j]), int(batch["cont_len"][j])
                cont = batch["continuation"][j][:cont_len]
                scores.append(float(-F.cross_entropy(logits[j][ctx_len - 1 : ctx_len + cont_len - 1], cont, reduction="sum")))
        out[label] = {
            "metric_type": task.metric_type,
            "samples": [
                {
                    "doc_id": s["doc_id"],
                    "cont_id": s["cont_id"],
                    "ctx": s["ctx"],
                    "continuation": s["continuation"],
                    "label": s["label_id"],
                    "cont_str_len": s["cont_str_len"],
                    "cont_byte_len": s["cont_byte_len"],
                }
                for s in keep
            ],
            "scores": scores,
            "metrics": {t: {k: float(v) for k, v in m.compute().items()} for t, m in metrics.items()},
        }
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
