"""Training parity with transformers: the same initial weights trained by the library's own
step (`moe train`'s Trainer) and by a plain transformers training loop, on the same batches.

    python -m bench.hf_parity --data data/tokens --layers 4 --steps 300 --seq 2048 --micro 4

Ours: the olmoe-1b-7b recipe's objective and optimizer (precision recipe bf16: bf16 weights,
fp32 master weights, fused AdamW, clipping inside it) with --lr and a warm-up of a tenth of
the steps. Theirs: ``OlmoeForCausalLM`` in fp32 under ``torch.autocast(bfloat16)`` (what a plain
loop does), ``torch.optim.AdamW(fused=True)`` with the same parameter groups (no decay on
norms and the embedding), ``clip_grad_norm_``, and the same schedule (moe.optim.lr_lambda). The
objective is written out in the loop from transformers' outputs (``output_router_logits``):
cross-entropy + per layer 0.01 * (E/k) * sum_i f_i P_i + 0.001 * mean(logsumexp(router)^2),
+ 1e-5 * mean(logsumexp(logits)^2), each micro-batch's share. The initial weights are our
model's fp32 master weights, copied into transformers' modules (checked: their logits agree
before anything trains). Batches come from the library's loader (same seed, same order).

Reported: the first step's loss of each, the largest relative gap of the two curves (each
smoothed over --window steps), and the mean loss of the last --tail steps and its relative
difference (the issue's bar: within 1%); a PNG of both curves and a JSON in bench/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import environment, print_table, write_result
from moe.config import ExperimentConfig
from moe.data import BatchLoader, TokenDataset
from moe.optim import lr_lambda
from moe.train.sinks import JsonlSink
from moe.train.trainer import Trainer


def config(a: argparse.Namespace, vocab: int, device: str) -> ExperimentConfig:
    return ExperimentConfig.load(
        {
            "recipe": "olmoe-1b-7b",
            "model": {
                "n_layers": a.layers,
                "vocab_size": vocab,
                **({"d_model": a.d_model, "n_heads": a.heads} if a.d_model else {}),
                **({"moe": {"num_experts": a.experts, "expert_hidden": a.expert_hidden}} if a.experts else {}),
            },
            "optim": {"lr": a.lr},
            "schedule": {"warmup_steps": max(1, a.steps // 10)},
            "data": {"paths": [str(Path(a.data) / "train")], "seq_len": a.seq},
            "train": {
                "global_batch_size": a.micro * a.accum,
                "micro_batch_size": a.micro,
                "max_steps": a.steps,
                "log_every": 1,
                "device": device,
                "seed": a.seed,
                "eval_every": 0,
            },
            "checkpoint": {"dir": str(Path(a.out) / "checkpoints"), "every": 0, "save": False},
            "precision": {"recipe": "bf16" if device == "cuda" else "fp32"},
        }
    )


def hf_model(cfg: ExperimentConfig, masters: dict[str, torch.Tensor], device: torch.device):
    """transformers' OLMoE holding exactly ``masters`` (our fp32 master weights)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    from moe.interop import hf_config, to_hf

    hf_cfg = OlmoeConfig(**hf_config(cfg.model, eos_id=0, pad_id=None))
    hf_cfg._experts_implementation = "grouped_mm" if device.type == "cuda" else "eager"
    with device:
        hf = OlmoeForCausalLM(hf_cfg)
    named = to_hf(cfg.model, masters)  # checkpoint names (one tensor per expert)
    own = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in own.items():
            if name in named:
                p.copy_(named.pop(name))
                continue
            layer = name.split(".experts.")[0]  # model.layers.L.mlp
            n = cfg.model.moe.num_experts
            if name.endswith("experts.gate_up_proj"):
                gate = torch.stack([named.pop(f"{layer}.experts.{e}.gate_proj.weight") for e in range(n)])
                up = torch.stack([named.pop(f"{layer}.experts.{e}.up_proj.weight") for e in range(n)])
                p.copy_(torch.cat([gate, up], dim=1).reshape(p.shape))
            elif name.endswith("experts.down_proj"):
                p.copy_(torch.stack([named.pop(f"{layer}.experts.{e}.down_proj.weight") for e in range(n)]).reshape(p.shape))
            else:
                raise SystemExit(f"transformers parameter {name} has no counterpart in our weights")
    if named:
        raise SystemExit(f"our tensors {sorted(named)[:3]} found no place in transformers' model")
    return hf.train()


def hf_objective(out, batch: torch.Tensor, cfg: ExperimentConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, the whole objective) of one micro-batch, as our step defines it."""
    m = cfg.model.moe
    logits = out.logits.float().flatten(0, 1)
    ce = F.cross_entropy(logits, batch[:, 1:].reshape(-1))
    total = ce + cfg.train.logit_z_loss_weight * torch.logsumexp(logits, -1).square().mean()
    for router in out.router_logits:
        router = router.float().reshape(-1, m.num_experts)
        probs = router.softmax(-1)
        chosen = probs.topk(m.top_k, dim=-1).indices.reshape(-1)
        fraction = torch.bincount(chosen, minlength=m.num_experts).float() / router.shape[0]
        lb = (m.num_experts / m.top_k) * (fraction * probs.mean(0)).sum()
        z = torch.logsumexp(router, -1).square().mean()
        total = total + m.lb_loss_weight * lb + m.z_loss_weight * z
    return ce, total


def train_hf(hf, cfg: ExperimentConfig, device: torch.device) -> tuple[list[float], float]:
    no_decay = [p for n, p in hf.named_parameters() if p.ndim < 2 or n == "model.embed_tokens.weight"]
    decay = [p for n, p in hf.named_parameters() if not (p.ndim < 2 or n == "model.embed_tokens.weight")]
    o = cfg.optim
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        fused=device.type == "cuda",
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.schedule, cfg.train.max_steps))
    data = TokenDataset(cfg.data.paths, cfg.data.seq_len)
    loader = BatchLoader(data, global_batch_size=cfg.train.global_batch_size, micro_batch_size=cfg.train.micro_batch_size, seed=cfg.data.seed)
    losses = []
    start = time.perf_counter()
    for _ in range(cfg.train.max_steps):
        micro = loader.next_batch()
        step_ce = torch.zeros((), device=device)
        for batch in micro:
            batch = batch.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = hf(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
            ce, total = hf_objective(out, batch, cfg)
            (total / len(micro)).backward()
            step_ce += ce.detach() / len(micro)
        torch.nn.utils.clip_grad_norm_(hf.parameters(), cfg.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_ce)
    values = [float(v) for v in torch.stack(losses).tolist()]
    return values, time.perf_counter() - start


def smooth(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def compare(ours: list[float], theirs: list[float], window: int, tail: int) -> dict[str, Any]:
    a, b = smooth(ours, window), smooth(theirs, window)
    gaps = [abs(x - y) / y for x, y in zip(a, b, strict=True)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    end_a, end_b = statistics.mean(ours[-tail:]), statistics.mean(theirs[-tail:])
    return {
        "first_ours": ours[0],
        "first_hf": theirs[0],
        "first_rel_diff": abs(ours[0] - theirs[0]) / theirs[0],
        "max_rel_gap_smoothed": gaps[worst],
        "max_gap_step": worst + 1,
        "final_ours": end_a,
        "final_hf": end_b,
        "final_rel_diff": abs(end_a - end_b) / end_b,
        "within_1pct": abs(end_a - end_b) / end_b <= 0.01,
        "loss_fell_ours": end_a < ours[0],
        "loss_fell_hf": end_b < theirs[0],
    }


def plot(ours: list[float], theirs: list[float], window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(ours) + 1)
    ax.plot(steps, smooth(ours, window), label="moe train (ours)")
    ax.plot(steps, smooth(theirs, window), label="transformers loop", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {window} steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a tokenised corpus (`moe tokenize` output: manifest.json and train/)")
    p.add_argument("--out", default="runs/hf_parity")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=None, help="override OLMoE's width (CPU smoke tests)")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--expert-hidden", type=int, default=None)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--tail", type=int, default=50)
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    manifest = Path(a.data) / "manifest.json"
    if not manifest.is_file():
        print(f"{manifest}: not found (a tokenised corpus from `moe tokenize`)", file=sys.stderr)
        return 2
    vocab = max(256, int(json.loads(manifest.read_text())["tokenizer"]["vocab_size"]))
    report(a, run(a, vocab))
    return 0


def run(a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Both trainings from the same weights: the config, the initial logits' agreement, and each
    side's loss curve and seconds."""
    device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(a, vocab, device_name)
    trainer = Trainer(cfg, sinks=[JsonlSink(out / "metrics.jsonl")])
    hf, agree = same_weights_peer(trainer, cfg, device)
    start = time.perf_counter()
    summary = trainer.fit()
    ours_s = time.perf_counter() - start
    ours = [summary.losses[s] for s in sorted(summary.losses)]
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    theirs, hf_s = train_hf(hf, cfg, device)
    return {"cfg": cfg, "agree": agree, "ours": ours, "ours_s": ours_s, "theirs": theirs, "hf_s": hf_s}


def same_weights_peer(trainer: Trainer, cfg: ExperimentConfig, device: torch.device):
    """transformers' model holding the trainer's fp32 master weights, and the relative error of its
    logits against ours on a probe batch (refuses to go on when they do not agree)."""
    masters = {q.name: q.master.detach().clone() for q in trainer.opt.params}
    hf = hf_model(cfg, {k: v.float() for k, v in masters.items()}, device)
    probe = TokenDataset(cfg.data.paths, cfg.data.seq_len).batch(list(range(2))).to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        ours_logits = trainer.model(probe[:, :-1]).float()
        hf_logits = hf(input_ids=probe[:, :-1], use_cache=False).logits.float()
    agree = ((ours_logits - hf_logits).norm() / hf_logits.norm()).item()
    print(f"initial logits, ours vs transformers: rel err {agree:.2e}")
    if agree > 2e-2:
        raise SystemExit("the two models do not compute the same function: refusing to compare training")
    return hf, agree


def report(a: argparse.Namespace, got: dict[str, Any]) -> None:
    """The table, the verdict, the PNG, ``--out``/result.json and the JSON in bench/results/."""
    ours, theirs, cfg = got["ours"], got["theirs"], got["cfg"]
    result = compare(ours, theirs, a.window, min(a.tail, len(ours)))
    rows = [
        {
            "what": "moe train (ours)",
            "first": result["first_ours"],
            f"last {a.tail} mean": result["final_ours"],
            "seconds": got["ours_s"],
            "s_per_step": got["ours_s"] / len(ours),
        },
        {
            "what": "transformers loop",
            "first": result["first_hf"],
            f"last {a.tail} mean": result["final_hf"],
            "seconds": got["hf_s"],
            "s_per_step": got["hf_s"] / len(theirs),
        },
    ]
    print_table(rows, ["what", "first", f"last {a.tail} mean", "seconds", "s_per_step"])
    print(
        f"final rel diff {result['final_rel_diff']:.4%} (bar 1%: {'met' if result['within_1pct'] else 'NOT met'}); "
        f"largest smoothed gap {result['max_rel_gap_smoothed']:.3%} at step {result['max_gap_step']}; first-step rel diff "
        f"{result['first_rel_diff']:.2e}"
    )
    out = Path(a.out)
    png = out / "hf_parity.png"
    plot(ours, theirs, a.window, png)
    payload = {
        "benchmark": "hf_parity",
        "environment": environment(),
        "config": {**vars(a), "resolved": cfg.to_dict()},
        "initial_logits_rel_err": got["agree"],
        "result": result,
        "rows": rows,
        "curves": {"ours": ours, "hf": theirs},
        "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_len,
    }
    (out / "result.json").write_text(json.dumps(payload, indent=2) + "\n")
    if not a.no_save:
        print(f"wrote {write_result('hf_parity', payload)} and {png}")


if __name__ == "__main__":
    sys.exit(main())
