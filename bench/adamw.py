"""The optimizer step on one GPU: torch's fused AdamW + the copy into the bf16 weights against
moe.kernels.adamw (one pass per tensor that also writes the bf16 copy), through
MasterWeightAdamW on the parameter shapes of a real model (built on the meta device, then
materialised in bf16 on the GPU), with a clipping scale as the trainer passes it.

    python -m bench.adamw [--width olmoe|qwen] [--layers 8] [--iters 20]

Before timing, one step of each from the same state on the same random gradients is checked:
masters and moments agree within fp32 rounding, and the Triton path's bf16 weights are its
masters rounded to nearest (bitwise). Bytes per parameter: torch 38 (28 for the step, 4 for
the gradient written back under a scale, 6 for the copy), Triton 30. Prints a table (median
ms, TB/s of each variant's own bytes) and writes JSON to bench/results/adamw-<device>-<time>.json."""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from bench.common import environment, print_table, save_result, time_cuda

SHAPES = {
    "olmoe": {},
    "qwen": {"vocab_size": 8192, "moe": {"num_experts": 128, "expert_hidden": 768, "top_k": 8}},
}
BYTES = {"torch": 38, "triton": 30}


def model_params(width: str, layers: int) -> list[tuple[str, torch.Size]]:
    from moe.config import ExperimentConfig
    from moe.model import Transformer

    over = dict(SHAPES[width])
    moe = over.pop("moe", {})
    cfg = ExperimentConfig.load({"model": {"preset": "olmoe-1b-7b", "n_layers": layers, **over, "moe": moe}})
    with torch.device("meta"):
        model = Transformer(cfg.model)
    return [(n, p.shape) for n, p in model.named_parameters()]


def build(shapes, kernel: str, seed: int = 0):
    from moe.config import OptimizerConfig
    from moe.optim import MasterWeightAdamW

    gen = torch.Generator(device="cuda").manual_seed(seed)
    module = torch.nn.Module()
    for i, (_, shape) in enumerate(shapes):
        w = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        w.normal_(0, 0.02, generator=gen)
        module.register_parameter(f"p{i}", torch.nn.Parameter(w))
    opt = MasterWeightAdamW(module, OptimizerConfig(lr=1e-3, step_kernel=kernel), master_weights=True)
    for p in opt.params:
        p.grad_holder.grad = torch.empty(p.param.shape, device="cuda").normal_(0, 1e-3, generator=gen)
    opt.ensure_state()
    return module, opt


def check(shapes) -> dict[str, float]:
    """One step of each kernel from the same state: the largest relative master difference,
    and whether the Triton path's bf16 weights are its masters rounded (bitwise)."""
    found, scale = torch.zeros((), device="cuda"), torch.tensor(0.7, device="cuda")
    results, before = {}, {}
    for kernel in ("torch", "triton"):
        module, opt = build(shapes[:12], kernel)
        assert opt._triton_steps() == (kernel == "triton"), kernel
        before[kernel] = [p.param.detach().clone() for p in opt.params]
        opt.step(found_inf=found, grad_scale=scale)
        results[kernel] = (module, opt)
    ref, tri = results["torch"][1], results["triton"][1]
    worst = 0.0
    for a, b in zip(tri.masters, ref.masters, strict=True):
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    mirrors_exact = all(torch.equal(p.param, p.master.to(torch.bfloat16)) for p in tri.params)
    moved = all(not torch.equal(p.param, b) for p, b in zip(tri.params, before["triton"], strict=True))
    assert worst < 1e-5 and mirrors_exact and moved, (worst, mirrors_exact, moved)
    release(ref)
    release(tri)
    return {"max_rel_master_diff": worst, "mirrors_exact": mirrors_exact}


def release(opt) -> None:
    """Free an optimizer's tensors now: the parameters' gradient hooks (kept on the C++ side)
    hold it past the garbage collector, and two at the Qwen-like shape do not fit at once."""
    for p in opt.params:
        p.grad_holder.grad = None
        p.param.data = torch.empty(0, device=p.param.device, dtype=p.param.dtype)
        if p.master is not None:
            p.master.data = torch.empty(0, device=p.master.device)
    opt.inner.state.clear()
    gc.collect()
    torch.cuda.empty_cache()


def time_step(shapes, kernel: str, found: torch.Tensor, scale: torch.Tensor, iters: int) -> dict[str, float]:
    _, opt = build(shapes, kernel)
    t = time_cuda(lambda: opt.step(found_inf=found, grad_scale=scale), warmup=3, iters=iters)
    release(opt)
    return {"median_ms": t["median_ms"], "min_ms": t["min_ms"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", choices=sorted(SHAPES), default="olmoe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    shapes = model_params(args.width, args.layers)
    numel = sum(s.numel() for _, s in shapes)
    checked = check(shapes)
    rows = []
    found, scale = torch.zeros((), device="cuda"), torch.tensor(0.7, device="cuda")
    for kernel in ("torch", "triton"):
        t = time_step(shapes, kernel, found, scale, args.iters)
        rows.append({"kernel": kernel, "params": numel, **t, "tb_per_s": BYTES[kernel] * numel / t["median_ms"] / 1e9})
    rows[1]["speedup"] = rows[0]["median_ms"] / rows[1]["median_ms"]
    print_table(rows, ["kernel", "params", "median_ms", "min_ms", "tb_per_s", "speedup"])
    payload = {"environment": environment(), "config": vars(args), "check": checked, "rows": rows}
    save_result("adamw", payload, save=not args.no_save)
    return 0


if __name__ == "__main__":
    sys.exit(main())
