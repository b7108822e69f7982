"""Downstream evaluation speed on one GPU: a whole suite scored by an OLMoE-1B-7B-width model.

    moe tasks --export core.json.gz --tokenizer data/tokens/tokenizer.json --task core
    python -m bench.eval --requests core.json.gz --layers 16 --repeats 3

The model is OLMoE-1B-7B's shape (d=2048, 16 heads, 64 experts of 1024, top-8; --layers of
them) in bf16, randomly initialised (std 0.02, seed 0): its accuracy is chance, and the bench
measures time only. The requests are what the evaluate stage and the in-loop evaluation score
(``moe tasks --export``: OLMo's formulations of the tasks, tokenised; every document of every
task unless the export was limited).

Rows, all on the same weights and requests in the same run:
- ours: the library's scorer (moe.eval.scoring): one-token continuations that share a context
  in one sequence, sequences sorted by length, batches of at most --batch-tokens padded tokens.
- ours, plain batches: the same model fed as a plain evaluator loop does (a fixed number of
  requests per batch in data order, each request its own sequence, padded to the longest).
- transformers: OlmoeForCausalLM (its default experts implementation) with our weights,
  through our scorer, on the --peer-limit first documents of each task.
Before timing, every row's per-request log-likelihoods are compared with ours, and ours with
an unbatched forward of sampled requests (no padding), and checked finite and not constant.

FLOPs (forward only, the useful tokens): 2 * matmul-active parameters (attention and expert
projections, router, lm head) per token plus causal attention 2 * layers * d_model * S^2 per
sequence of S tokens; divided by the measured bf16 matmul ceiling of this GPU and by the
datasheet peak. Routing: learned router of a random model (dropless, top-8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import environment, matmul_peak_tflops, print_table, save_result
from moe.config import ExperimentConfig, ModelConfig
from moe.eval.requests import Request, TaskRequests, load_task_requests
from moe.eval.scoring import score_requests
from moe.eval.suite import evaluate_suite
from moe.hardware import gpu_by_device_name
from moe.model import Transformer
from moe.plan.accounting import param_counts

DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}


def build_model(a: argparse.Namespace, vocab: int, device: torch.device) -> Transformer:
    model: dict = {"preset": a.preset, "n_layers": a.layers, "vocab_size": vocab}
    moe = {k: v for k, v in (("num_experts", a.experts), ("expert_hidden", a.expert_hidden)) if v is not None}
    if moe:
        model["moe"] = moe
    if a.d_model is not None:
        model["d_model"] = a.d_model
    cfg = ExperimentConfig.load({"model": model}).model
    torch.manual_seed(0)
    with device:
        built = Transformer(cfg)
    return built.to(DTYPE[device.type]).eval()


def hf_peer(model: Transformer, pad_id: int, device: torch.device, scratch: Path):
    """transformers' model of the same weights, loaded as a user loads ours (from_pretrained of
    a saved directory: its own checkpoint conversion runs)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from moe.interop import hf_config, to_hf

    dtype = DTYPE[device.type]
    (scratch / "config.json").write_text(json.dumps(hf_config(model.cfg, eos_id=pad_id, pad_id=pad_id, dtype=str(dtype).split(".")[1])))
    save_file({k: v.to(dtype).contiguous() for k, v in to_hf(model.cfg, model.state_dict()).items()}, str(scratch / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(scratch, dtype=dtype).to(device).eval()
    return lambda ids: hf(input_ids=ids, use_cache=False).logits, getattr(hf.config, "_experts_implementation", None)


def plain_scores(forward, requests: list[Request], *, max_len: int, per_batch: int, pad_id: int, device: torch.device) -> dict[int, float]:
    """A plain evaluator loop: ``per_batch`` requests at a time in data order, padded to the longest."""
    out: list[torch.Tensor] = []
    for start in range(0, len(requests), per_batch):
        chunk = requests[start : start + per_batch]
        queries = [r.query(max_len) for r in chunk]
        width = max(len(q) for q, _ in queries)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for row, (q, _) in enumerate(queries):
            ids[row, : len(q)] = torch.tensor(q)
        logp = torch.log_softmax(forward(ids.to(device)).float(), dim=-1)
        sums = []
        for row, (r, (_, first)) in enumerate(zip(chunk, queries, strict=True)):
            positions = torch.arange(first, first + len(r.cont), device=device)
            sums.append(logp[row, positions, torch.tensor(r.cont, device=device)].sum())
        out.append(torch.stack(sums))
    values = torch.cat(out).tolist()
    return dict(enumerate(values))


def forward_flops(cfg: ModelConfig, requests: list[Request], max_len: int) -> float:
    """Useful forward FLOPs of scoring ``requests`` one sequence each (see the module docstring)."""
    n = param_counts(cfg).matmul_active
    total = 0.0
    for r in requests:
        s = len(r.query(max_len)[0])
        total += 2.0 * n * s + 2.0 * cfg.n_layers * cfg.d_model * s * s
    return total


def shared_sequences(requests: list[Request], max_len: int) -> list[tuple[int, ...]]:
    """The distinct sequences our scorer runs (one-token continuations share their context)."""
    seen: dict[tuple[int, ...], None] = {}
    out = []
    for r in requests:
        ids = r.query(max_len)[0]
        if len(r.cont) == 1:
            if ids in seen:
                continue
            seen[ids] = None
        out.append(ids)
    return out


def sequence_flops(cfg: ModelConfig, seqs: list[tuple[int, ...]]) -> float:
    n = param_counts(cfg).matmul_active
    return sum(2.0 * n * len(s) + 2.0 * cfg.n_layers * cfg.d_model * len(s) ** 2 for s in seqs)


def limited(tasks: list[TaskRequests], docs: int) -> list[TaskRequests]:
    out = []
    for t in tasks:
        keep = sorted({r.doc_id for r in t.requests})[:docs]
        chosen = set(keep)
        out.append(dataclasses.replace(t, requests=tuple(r for r in t.requests if r.doc_id in chosen)))
    return out


def check_unbatched(
    forward, tasks: list[TaskRequests], scores: dict[str, dict[int, float]], max_len: int, samples: int, device: torch.device
) -> float:
    """Max |batched - unbatched| log-likelihood over ``samples`` random requests (raises if off)."""
    rng = random.Random(0)
    pool = [(t.name, i, r) for t in tasks for i, r in enumerate(t.requests)]
    worst = 0.0
    for name, i, r in rng.sample(pool, min(samples, len(pool))):
        alone = score_requests(forward, [r], max_len=max_len, device=device)[0]
        worst = max(worst, abs(alone - scores[name][i]))
    return worst


def check_scores(scores: dict[str, dict[int, float]]) -> None:
    values = [v for s in scores.values() for v in s.values()]
    t = torch.tensor(values, dtype=torch.float64)
    if not torch.isfinite(t).all():
        raise SystemExit("non-finite log-likelihoods: refusing to time")
    if t.std() == 0:
        raise SystemExit("every log-likelihood is equal: refusing to time a degenerate model")


def max_diff(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> float:
    return max(abs(a[t][i] - b[t][i]) for t in b for i in b[t])


def timed(fn, repeats: int, device: torch.device) -> tuple[float, list[float], object]:
    """Median wall seconds of ``repeats`` runs (each ends in a host transfer of its scores)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, result = [], None
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=Path, required=True, help="`moe tasks --export` output")
    p.add_argument("--preset", default="olmoe-1b-7b")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--d-model", type=int, default=None, help="override the preset's (CPU smoke tests)")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--expert-hidden", type=int, default=None)
    p.add_argument("--max-docs", type=int, default=None, help="the first documents of each task only (default: all)")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test)")
    p.add_argument("--batch-tokens", type=int, default=32768, help="padded tokens per batch (ours)")
    p.add_argument("--plain-batch", type=int, default=32, help="requests per batch of the plain loop")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the whole suite (median reported)")
    p.add_argument("--peer-limit", type=int, default=100, help="documents per task for the peer rows")
    p.add_argument("--peer-repeats", type=int, default=3)
    p.add_argument("--check-samples", type=int, default=48)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


@dataclasses.dataclass
class Setup:
    """What every row scores: the model, the requests (all, and the peers' subset) and how our
    scorer batches them."""

    model: Transformer
    tasks: list[TaskRequests]
    peers: list[TaskRequests]  # the --peer-limit first documents of each task
    meta: dict
    max_len: int
    pad: int
    device: torch.device
    batch_tokens: int

    @classmethod
    def load(cls, a: argparse.Namespace, device: torch.device) -> Setup:
        tasks, meta = load_task_requests(a.requests)
        if a.max_docs:
            tasks = limited(tasks, a.max_docs)
        model = build_model(a, int(meta["vocab_size"]), device)
        max_len = min(int(meta["max_len"]), model.cfg.max_seq_len)
        return cls(model, tasks, limited(tasks, a.peer_limit), meta, max_len, int(meta["pad_id"]), device, a.batch_tokens)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def ours(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)

    def suite(self, forward, chosen: list[TaskRequests]):
        return evaluate_suite(forward, chosen, max_len=self.max_len, device=self.device, batch_tokens=self.batch_tokens, pad_id=self.pad)


def docs_and_requests(tasks: list[TaskRequests]) -> tuple[int, list[Request]]:
    return sum(len({r.doc_id for r in t.requests}) for t in tasks), [r for t in tasks for r in t.requests]


def row(what: str, seconds: float, times: list[float], tasks: list[TaskRequests], flops: float, peak: dict, diff=None, note="") -> dict:
    """One timed row: rates per document, request and FLOP, against the measured and datasheet peaks."""
    n_docs, requests = docs_and_requests(tasks)
    tflops = flops / seconds / 1e12
    matmul, datasheet = peak["matmul_measured_tflops"], peak["datasheet_bf16_tflops"]
    return {
        "what": what,
        "docs": n_docs,
        "requests": len(requests),
        "seconds": seconds,
        "runs_s": times,
        "examples_per_s": n_docs / seconds,
        "requests_per_s": len(requests) / seconds,
        "tflops": tflops,
        "of_matmul": tflops / matmul if matmul else None,
        "of_datasheet": tflops / datasheet if datasheet else None,
        "max_ll_diff_vs_ours": diff,
        "note": note,
    }


def check_before_timing(a: argparse.Namespace, s: Setup) -> tuple[dict[str, dict[int, float]], float]:
    """Warm-up and checks on the peer subset: ours against unbatched, not degenerate. Our scores
    of the subset and the largest batched-unbatched difference."""
    _, ours_peer = s.suite(s.ours, s.peers)
    check_scores(ours_peer)
    unbatched = check_unbatched(s.ours, s.peers, ours_peer, s.max_len, a.check_samples, s.device)
    print(f"ours batched vs unbatched (no padding), {a.check_samples} sampled requests: max |diff| {unbatched:.4f} nats")
    if unbatched > 0.25:
        raise SystemExit("batched and unbatched scores disagree: refusing to time")
    return ours_peer, unbatched


def peaks(device: torch.device) -> dict:
    matmul = matmul_peak_tflops() if device.type == "cuda" else None
    spec = gpu_by_device_name(torch.cuda.get_device_name()) if device.type == "cuda" else None
    return {"matmul_measured_tflops": matmul, "datasheet_bf16_tflops": spec.peak_bf16_tflops if spec else None}


def subset_rows(a: argparse.Namespace, s: Setup, ours_peer: dict[str, dict[int, float]], peak: dict) -> list[dict]:
    """The peers on the subset: ours, ours fed as a plain loop, and transformers (unless --no-hf)."""
    _, peer_requests = docs_and_requests(s.peers)
    subset_flops = sequence_flops(s.cfg, shared_sequences(peer_requests, s.max_len))
    sec, times, _ = timed(lambda: s.suite(s.ours, s.peers), a.peer_repeats, s.device)
    rows = [row("ours (subset)", sec, times, s.peers, subset_flops, peak, 0.0, f"batch_tokens={a.batch_tokens}")]

    def plain():
        return {
            t.name: plain_scores(s.ours, list(t.requests), max_len=s.max_len, per_batch=a.plain_batch, pad_id=s.pad, device=s.device) for t in s.peers
        }

    sec, times, got = timed(plain, a.peer_repeats, s.device)
    flops = forward_flops(s.cfg, peer_requests, s.max_len)
    note = f"{a.plain_batch} requests per batch, data order"
    rows.append(row("ours, plain batches (subset)", sec, times, s.peers, flops, peak, max_diff(ours_peer, got), note))
    if not a.no_hf:
        rows.append(transformers_row(a, s, ours_peer, subset_flops, peak))
        if s.device.type == "cuda":
            torch.cuda.empty_cache()  # transformers' model is gone
    return rows


def transformers_row(a: argparse.Namespace, s: Setup, ours_peer: dict[str, dict[int, float]], flops: float, peak: dict) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        hf, impl = hf_peer(s.model, s.pad, s.device, Path(scratch))
    _, hf_scores = s.suite(hf, s.peers)  # warm-up, and the agreement
    sec, times, _ = timed(lambda: s.suite(hf, s.peers), a.peer_repeats, s.device)
    note = f"experts_implementation={impl}, our scorer"
    return row("transformers OlmoeForCausalLM (subset)", sec, times, s.peers, flops, peak, max_diff(ours_peer, hf_scores), note)


def run(a: argparse.Namespace, device: torch.device) -> dict:
    """Every row, all on the same weights and requests; the whole suite's per-task results."""
    s = Setup.load(a, device)
    with torch.no_grad():
        ours_peer, unbatched = check_before_timing(a, s)
        peak = peaks(device)
        rows = subset_rows(a, s, ours_peer, peak)
        _, all_requests = docs_and_requests(s.tasks)
        full_flops = sequence_flops(s.cfg, shared_sequences(all_requests, s.max_len))
        sec, times, (results, _) = timed(lambda: s.suite(s.ours, s.tasks), a.repeats, device)
        rows.append(row("ours (whole suite)", sec, times, s.tasks, full_flops, peak, None, f"batch_tokens={a.batch_tokens}"))
    base = rows[0]["seconds"]
    for r in rows[:-1]:
        r["time_vs_ours"] = r["seconds"] / base
    return {"setup": s, "rows": rows, "results": results, "peak": peak, "unbatched": unbatched}


ROW_COLUMNS = [
    "what",
    "docs",
    "requests",
    "seconds",
    "examples_per_s",
    "requests_per_s",
    "tflops",
    "of_matmul",
    "max_ll_diff_vs_ours",
    "time_vs_ours",
    "note",
]


def report(a: argparse.Namespace, got: dict) -> None:
    s, rows, results, peak = got["setup"], got["rows"], got["results"], got["peak"]
    cfg, counts = s.cfg, param_counts(s.cfg)
    print(
        f"{a.preset} (d_model {cfg.d_model}, {cfg.moe.num_experts} experts), {a.layers} layers, "
        f"{counts.total / 1e9:.2f}B params ({counts.active / 1e9:.2f}B active), "
        f"{DTYPE[s.device.type]}, random init; {len(s.tasks)} tasks from {a.requests.name}; "
        f"matmul ceiling {peak['matmul_measured_tflops'] or float('nan'):.0f} TFLOP/s, datasheet {peak['datasheet_bf16_tflops']}"
    )
    print_table(rows, ROW_COLUMNS)
    per_task = [
        {
            "task": t.name,
            "docs": int(len({q.doc_id for q in t.requests})),
            "requests": len(t.requests),
            "seconds": results[t.name]["seconds"],
            "examples_per_s": len({q.doc_id for q in t.requests}) / results[t.name]["seconds"],
        }
        for t in s.tasks
    ]
    print_table(per_task, ["task", "docs", "requests", "seconds", "examples_per_s"])
    payload = {
        "benchmark": "eval",
        "environment": environment(),
        "config": {**{k: str(v) for k, v in vars(a).items()}, **s.meta},
        "model": {
            "preset": a.preset,
            **cfg.to_dict(),
            "dtype": str(DTYPE[s.device.type]),
            "init": "random std 0.02 seed 0",
            "params": counts.total,
            "active_params": counts.active,
        },
        "flop_formula": "2 * matmul_active_params * tokens + 2 * layers * d_model * S^2 per sequence (forward, useful tokens)",
        "peak": peak,
        "routing": "learned router of a random model, dropless top-8",
        "unbatched_max_diff": got["unbatched"],
        "rows": rows,
        "per_task": per_task,
    }
    save_result("eval", payload, save=not a.no_save)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    report(a, run(a, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
