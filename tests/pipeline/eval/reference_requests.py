"""Our requests against the ones ai2-olmo-eval's own builder makes (`build_task(...).samples`, run
in its own venv: its pins clash with ours), for the same documents and a small BPE tokenizer
trained on the tasks' text. Shared by test_gold_bpb and test_core_bpb."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

BUILDER = """
import json, sys
from olmo_eval.tasks import build_task
from olmo_eval.tokenizer import HFTokenizer
spec = json.load(open(sys.argv[1]))
tok = HFTokenizer(spec["tokenizer"], pad_token_id=spec["eos_id"], eos_token_id=spec["eos_id"])
out = {}
for label, doc_ids in spec["doc_ids"].items():
    keep = set(doc_ids)
    out[label] = [[s["doc_id"], s["cont_id"], s["ctx"], s["continuation"], s["label_id"], s["cont_byte_len"]]
                  for s in build_task(label, tok, model_ctx_len=spec["max_len"]).samples if s["doc_id"] in keep]
json.dump(out, open(sys.argv[2], "w"))
"""


def ours_and_reference(tmp_path: Path, reference_python: Path, text: list[str], names: list[str], limit: int) -> dict[str, tuple[list, list]]:
    """Per task: (our requests, ai2-olmo-eval's for the same documents), each sorted rows of
    [doc_id, cont_id, context ids, continuation ids, label, continuation bytes]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pipeline.eval.requests import prepare_tasks
    from pipeline.tokenizer import describe

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        text, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    info = describe(tok)
    max_len = 1 << 14
    ours = {t.name: t for t in prepare_tasks(names, info, limit=limit, data_dir=None, key="test", max_len=max_len)}
    assert list(ours) == names
    spec = {"tokenizer": str(tmp_path / "tokenizer.json"), "eos_id": info.eos_id, "max_len": max_len}
    spec["doc_ids"] = {n: sorted({q.doc_id for q in t.requests}) for n, t in ours.items()}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "build.py").write_text(BUILDER)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [str(reference_python), str(tmp_path / "build.py"), str(tmp_path / "spec.json"), str(tmp_path / "ref.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads((tmp_path / "ref.json").read_text())
    return {
        name: (sorted([q.doc_id, q.cont_id, list(q.ctx), list(q.cont), q.label, q.cont_bytes] for q in t.requests), sorted(ref[name]))
        for name, t in ours.items()
    }
