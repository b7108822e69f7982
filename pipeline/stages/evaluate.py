"""Evaluate stage: validation loss and perplexity from our model and from the converted
checkpoint loaded through transformers (they must agree), evaluation speed, and a greedy
generation sample from both."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moe.data import TokenDataset
from moe.model import Transformer
from moe.parallel.env import pick_device
from pipeline.errors import PipelineError
from pipeline.params import PipelineConfig
from pipeline.plots import validation_figure
from pipeline.stages.convert import load_checkpoint_weights
from pipeline.stages.tokenize import read_manifest
from pipeline.stages.train import read_metric_rows
from pipeline.tokenizer import load_tokenizer


def load_our_model(checkpoint: str | Path, device: torch.device) -> Transformer:
    cfg, state, _ = load_checkpoint_weights(checkpoint)
    with torch.device(device):
        model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise PipelineError(f"{checkpoint}: checkpoint does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


@torch.no_grad()
def mean_loss(forward, batches: list[torch.Tensor]) -> tuple[float, int, float]:
    """(mean token loss, tokens, seconds) over the batches."""
    total, count = 0.0, 0
    start = time.perf_counter()
    for batch in batches:
        logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    return total / count, count, time.perf_counter() - start


@torch.no_grad()
def greedy(model: Transformer, prompt: list[int], new_tokens: int, eos_id: int, device: torch.device) -> list[int]:
    ids = list(prompt)
    for _ in range(new_tokens):
        if len(ids) >= model.cfg.max_seq_len:
            break
        logits = model(torch.tensor([ids], device=device))
        nxt = int(logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == eos_id:
            break
    return ids[len(prompt):]


def run_evaluate(cfg: PipelineConfig, tracker=None, checkpoint: str | None = None, hf_dir: str | None = None) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    device = pick_device(cfg.evaluate.device)
    checkpoint = checkpoint or cfg.checkpoint.dir
    hf_dir = Path(hf_dir or cfg.convert.output)
    manifest = read_manifest(cfg.tokenize.output)
    tok_info = load_tokenizer(Path(cfg.tokenize.output) / "tokenizer.json")
    if tok_info.sha256 != manifest["tokenizer"]["sha256"]:
        raise PipelineError(f"{cfg.tokenize.output}/tokenizer.json does not match its manifest (tokenizer hash differs)")

    ours = load_our_model(checkpoint, device)
    if not (hf_dir / "config.json").is_file():
        raise PipelineError(f"{hf_dir}: no converted model; run the convert stage first (moe convert)")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    if type(hf).__name__ != "OlmoeForCausalLM":
        raise PipelineError(f"{hf_dir}: transformers loaded {type(hf).__name__}, not OlmoeForCausalLM")

    seq_len = min(cfg.data.seq_len, ours.cfg.max_seq_len)
    val = TokenDataset([str(Path(cfg.tokenize.output) / "val")], seq_len, tokenizer_hash=tok_info.sha256)
    limit = cfg.evaluate.max_batches
    n = len(val) if limit is None else min(len(val), cfg.evaluate.batch_size * limit)
    index = np.arange(n)
    batches = [val.batch(index[i : i + cfg.evaluate.batch_size]).to(device) for i in range(0, n, cfg.evaluate.batch_size)]

    loss, tokens, seconds = mean_loss(ours, batches)
    hf_loss, _, hf_seconds = mean_loss(lambda x: hf(x).logits, batches)
    rel = abs(loss - hf_loss) / max(abs(hf_loss), 1e-12)
    if not rel <= cfg.evaluate.max_rel_diff:
        raise PipelineError(
            f"our validation loss {loss:.6f} and transformers' {hf_loss:.6f} differ by {rel:.2e} "
            f"(> evaluate.max_rel_diff={cfg.evaluate.max_rel_diff}): the conversion is wrong"
        )

    tok = tok_info.build()
    prompt = tok.encode(cfg.evaluate.prompt, add_special_tokens=False).ids or [tok_info.eos_id]
    ours_ids = greedy(ours, prompt, cfg.evaluate.generate_tokens, tok_info.eos_id, device)
    hf_out = hf.generate(
        torch.tensor([prompt], device=device), max_new_tokens=cfg.evaluate.generate_tokens, do_sample=False,
        eos_token_id=tok_info.eos_id, pad_token_id=tok_info.pad_id if tok_info.pad_id is not None else tok_info.eos_id,
    )
    hf_ids = hf_out[0, len(prompt):].tolist()
    sample = cfg.evaluate.prompt + tok.decode(ours_ids, skip_special_tokens=False)

    metrics = {
        "val_loss": loss,
        "val_perplexity": math.exp(min(loss, 80.0)),
        "hf_val_loss": hf_loss,
        "hf_rel_diff": rel,
        "val_tokens": tokens,
        # the windows evaluated and the split's total: equal unless evaluate.max_batches cut it
        "val_windows": n,
        "val_windows_total": len(val),
        "eval_tokens_per_s": tokens / seconds,
        "hf_eval_tokens_per_s": tokens / hf_seconds,
        "generation_matches_hf": float(ours_ids == hf_ids),
    }
    out = Path(cfg.evaluate.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    sample_path = out.with_name(out.stem + "_sample.txt")
    sample_path.write_text(sample + "\n")
    out.write_text(json.dumps(metrics, indent=2) + "\n")
    train_rows = Path(cfg.executor.run_dir) / "metrics.jsonl"
    validation_figure(read_metric_rows(train_rows) if train_rows.is_file() else [], loss, hf_loss)
    if tracker:
        tracker.log_metrics(metrics)
        tracker.log_artifact(sample_path)
    return {**metrics, "sample": sample}
