"""MoE layer forward+backward TFLOP/s, ours side by side with transformers, TorchTitan and SonicMoE.

    python -m bench.layer                      # the two reference shapes, 16384 tokens, bf16
    python -m bench.layer --shape 2048,1024,64,8 --tokens 4096 --peers ours,titan
    python -m bench.layer --peers ours,ours_fp8,ours_fp8_all   # FP8 rowwise against our bf16
    python -m bench.layer --peers ours,gemm,sonic   # and the grouped GEMMs alone: the ceiling

SonicMoE (``sonic-moe`` 0.1.2, Python >= 3.12, Hopper) is optional: where it does not import,
its row is skipped with a printed note and the run does not fail.

Every peer gets the same router and expert weights and the same random input, so the routing
distribution is identical; outputs and input gradients are checked against an fp32 run of our
layer before anything is timed. FLOPs per layer call (forward + backward) are
6 * tokens * (top_k * 3 * d * h + d * E): the routed experts' GEMMs and the router.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench.common import environment, matmul_peak_tflops, print_table, rel_error, save_result, time_cuda
from moe.config import MoEConfig
from moe.layers import MoELayer

REFERENCE_SHAPES = [(2048, 1024, 64, 8), (4096, 4096, 64, 4)]
TOLERANCE = 0.1  # bf16 against fp32; a peer with a bf16 router flips near-tie routes (HF does)


@dataclasses.dataclass(frozen=True)
class Shape:
    d: int
    h: int
    experts: int
    top_k: int

    @property
    def label(self) -> str:
        return f"d={self.d}/h={self.h}/E={self.experts}/k={self.top_k}"

    def flops(self, tokens: int) -> float:
        return 6.0 * tokens * (self.top_k * 3 * self.d * self.h + self.d * self.experts)


def make_weights(shape: Shape, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    s = shape

    def randn(*size: int) -> torch.Tensor:
        # bf16-representable values: the fp32 reference then differs only in arithmetic
        return (torch.randn(*size, generator=g, device=device) * 0.02).bfloat16().float()

    return {
        "router": randn(s.experts, s.d),
        "w1": randn(s.experts, s.h, s.d),  # gate
        "w3": randn(s.experts, s.h, s.d),  # up
        "w2": randn(s.experts, s.d, s.h),  # down
    }


def build_ours(shape: Shape, w: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    cfg = MoEConfig(num_experts=shape.experts, top_k=shape.top_k, expert_hidden=shape.h).validate()
    layer = MoELayer(shape.d, cfg).to(w["router"].device)
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        layer.experts.gate_up.copy_(torch.cat([w["w1"], w["w3"]], dim=1))
        layer.experts.down.copy_(w["w2"])
    return layer.to(dtype).train()


def build_hf(shape: Shape, w: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    cfg = OlmoeConfig(
        hidden_size=shape.d,
        intermediate_size=shape.h,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=False,
    )
    # What from_pretrained selects by default in transformers 5 (grouped_mm where it can run).
    cfg._experts_implementation = "grouped_mm"
    block = OlmoeSparseMoeBlock(cfg).to(w["router"].device)
    with torch.no_grad():
        block.gate.weight.copy_(w["router"])
        block.experts.gate_up_proj.copy_(torch.cat([w["w1"], w["w3"]], dim=1))
        block.experts.down_proj.copy_(w["w2"])
    block.bench_note = f"experts_implementation={getattr(cfg, '_experts_implementation', None)}"
    return block.to(dtype).train()


def build_titan(shape: Shape, w: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    s = shape
    cfg = MoE.Config(
        num_experts=s.experts,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=s.d, hidden_dim=s.h, num_experts=s.experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=s.experts, top_k=s.top_k),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=s.experts,
            gate=Linear.Config(in_features=s.d, out_features=s.experts),
            top_k=s.top_k,
            score_func="softmax",
            route_norm=False,
        ),
        load_balance_coeff=None,
    )
    moe = cfg.build().to(w["router"].device)
    with torch.no_grad():
        moe.router.gate.weight.copy_(w["router"])
        moe.routed_experts.inner_experts.w1_EFD.copy_(w["w1"])
        moe.routed_experts.inner_experts.w3_EFD.copy_(w["w3"])
        moe.routed_experts.inner_experts.w2_EDF.copy_(w["w2"])
    return moe.to(dtype).train()


def build_ours_fp8(shape: Shape, w: dict[str, torch.Tensor], dtype: torch.dtype, min_dim: int | None = None) -> nn.Module:
    """Our layer under the fp8_rowwise recipe's expert GEMM (min_dim=0: every GEMM in FP8)."""
    from moe.layers.gemm_fp8 import Fp8GroupedGemm, Fp8Rule

    layer = build_ours(shape, w, dtype)
    layer.experts.gemm = Fp8GroupedGemm(Fp8Rule() if min_dim is None else Fp8Rule(min_dim))
    layer.bench_note = f"fp8_min_dim={layer.experts.gemm.rule.min_dim}"
    return layer


class GroupedGemmOnly(nn.Module):
    """The layer's six expert GEMMs alone (forward, dgrad and wgrad of gate_up and of down)
    through our grouped-GEMM seam, on the rows and group sizes our router gives this input:
    the rate a layer would reach if routing, gather, SwiGLU and combine were free. Its FLOPs
    are the experts' only (no router)."""

    def __init__(self, shape: Shape, w: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        self.shape, self.layer = shape, build_ours(shape, w, dtype)
        self.bench_note = "grouped GEMMs only (moe.layers.gemm), our routing's group sizes"

    def bench_flops(self, tokens: int) -> float:
        s = self.shape
        return 6.0 * tokens * s.top_k * 3 * s.d * s.h

    @torch.no_grad()
    def prepare(self, x: torch.Tensor) -> None:
        s, experts = self.shape, self.layer.experts
        tokens = x.reshape(-1, s.d)
        routing = self.layer.router(tokens)
        order = torch.argsort(routing.experts.reshape(-1), stable=True)
        self.offsets = routing.tokens_per_expert.cumsum(0).to(torch.int32)
        g = torch.Generator(device=x.device).manual_seed(2)
        n = order.numel()

        def randn(*size: int) -> torch.Tensor:
            return torch.randn(*size, generator=g, device=x.device).to(experts.down.dtype)

        self.rows = tokens.index_select(0, order // s.top_k).detach().requires_grad_(True)
        self.act = randn(n, s.h).requires_grad_(True)  # what SwiGLU would hand the down projection
        self.grad_h, self.grad_out = randn(n, 2 * s.h), randn(n, s.d)

    def bench_step(self) -> None:
        experts = self.layer.experts
        h = experts.gemm(self.rows, experts.gate_up, self.offsets)
        out = experts.gemm(self.act, experts.down, self.offsets)
        torch.autograd.backward([h, out], [self.grad_h, self.grad_out])
        self.last = (h, out)

    def bench_clear(self) -> None:
        self.rows.grad = self.act.grad = None

    @torch.no_grad()
    def bench_check(self) -> tuple[float, float]:
        """Forward outputs and the rows' gradient against an fp32 per-expert loop."""
        experts = self.layer.experts
        h, out = self.last
        ref_h, ref_out = torch.empty_like(h, dtype=torch.float32), torch.empty_like(out, dtype=torch.float32)
        ref_dx = torch.empty_like(self.rows, dtype=torch.float32)
        start = 0
        for e, end in enumerate(self.offsets.tolist()):  # outside timing: a host loop is fine here
            rows, act = self.rows[start:end].float(), self.act[start:end].float()
            ref_h[start:end] = rows @ experts.gate_up[e].float().t()
            ref_out[start:end] = act @ experts.down[e].float().t()
            ref_dx[start:end] = self.grad_h[start:end].float() @ experts.gate_up[e].float()
            start = end
        return max(rel_error(h, ref_h), rel_error(out, ref_out)), rel_error(self.rows.grad, ref_dx)


class PeerUnavailable(Exception):
    """An optional peer that does not import here: skipped with a note, not an error."""


def sonic_weights(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our expert weights (gate_up [E, 2h, d] = [gate; up], down [E, d, h]) as SonicMoE's views:
    w1 (2h, d, E) and w2 (d, h, E), expert dimension outermost in memory (stride order 2, 0, 1);
    gate and up concatenated, not interleaved: ``concat_layout=True``."""
    return gate_up.permute(1, 2, 0), down.permute(1, 2, 0)


class SonicPeer(nn.Module):
    """sonic-moe 0.1.2's functional layer with OLMoE routing: softmax over all experts, then
    top-k without renormalisation (``is_softmax_over_topk=False, norm_topk_probs=False``)."""

    def __init__(self, shape: Shape, w: dict[str, torch.Tensor], dtype: torch.dtype, layer: Callable[..., Any]) -> None:
        super().__init__()
        self.shape, self.layer = shape, layer
        self.router = nn.Parameter(w["router"].to(dtype))
        self.gate_up = nn.Parameter(torch.cat([w["w1"], w["w3"]], dim=1).to(dtype).contiguous())
        self.down = nn.Parameter(w["w2"].to(dtype).contiguous())
        self.bench_note = "sonic-moe moe_TC_softmax_topk_layer, concat_layout=True"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        w1, w2 = sonic_weights(self.gate_up, self.down)
        out, _, _ = self.layer(
            x.reshape(-1, s.d),
            self.router,
            w1,
            None,
            w2,
            None,
            s.top_k,
            torch.cuda.current_stream().cuda_stream,
            "swiglu",
            False,
            is_softmax_over_topk=False,
            norm_topk_probs=False,
            concat_layout=True,
        )
        return out.view(x.shape)


def build_sonic(shape: Shape, w: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module:
    try:
        from sonicmoe import moe_TC_softmax_topk_layer
    except Exception as exc:  # not installed, Python < 3.12, no CUDA/CuTe DSL: an optional peer
        raise PeerUnavailable(f"sonic-moe does not import here ({type(exc).__name__}: {exc})") from exc
    return SonicPeer(shape, w, dtype, moe_TC_softmax_topk_layer).to(w["router"].device).train()


PEERS: dict[str, tuple[str, Callable[..., nn.Module]]] = {
    "ours": ("moe (this repo)", build_ours),
    "ours_fp8": ("moe, fp8_rowwise (per-shape rule)", build_ours_fp8),
    "ours_fp8_all": ("moe, fp8_rowwise (every GEMM FP8)", lambda s, w, d: build_ours_fp8(s, w, d, min_dim=0)),
    "hf": ("transformers OlmoeSparseMoeBlock", build_hf),
    "titan": ("torchtitan 0.3.0 MoE", build_titan),
    "sonic": ("sonic-moe 0.1.2 (optional)", build_sonic),
    "gemm": ("grouped GEMMs only (the ceiling)", GroupedGemmOnly),
}


def run_shape(
    shape: Shape, tokens: int, peers: list[str], iters: int, device: torch.device, args_weights_change: bool = True
) -> list[dict[str, Any]]:
    """args_weights_change: each timed call sees new weights (one layer call per optimizer step);
    False: the same weights every call (gradient accumulation, where FP8 weight copies are reused)."""
    w = make_weights(shape, device)
    g = torch.Generator(device=device).manual_seed(1)
    x32 = torch.randn(1, tokens, shape.d, generator=g, device=device).bfloat16().float()
    grad32 = torch.randn(1, tokens, shape.d, generator=g, device=device).bfloat16().float()
    ref = fp32_reference(shape, w, x32, grad32)
    rows = []
    for key in peers:
        rows.append(time_peer(key, shape, w, x32, grad32, ref, tokens, iters, args_weights_change))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ours = next((r for r in rows if r["peer"] == "ours" and "tflops" in r), None)
    for r in rows:
        if ours and "tflops" in r:
            r["ours_over_peer"] = ours["tflops"] / r["tflops"]
    return rows


def fp32_reference(shape: Shape, w: dict[str, torch.Tensor], x32: torch.Tensor, grad32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of our layer in fp32 (itself checked against a per-expert loop in the tests)."""
    ref_layer = build_ours(shape, w, torch.float32).eval()
    xr = x32.clone().requires_grad_(True)
    ref_out = ref_layer(xr)
    ref_out.backward(grad32)
    return ref_out, xr.grad


def time_peer(
    key: str,
    shape: Shape,
    w: dict[str, torch.Tensor],
    x32: torch.Tensor,
    grad32: torch.Tensor,
    ref: tuple[torch.Tensor, torch.Tensor],
    tokens: int,
    iters: int,
    weights_change: bool,
) -> dict[str, Any]:
    """One peer's row: built, checked against the fp32 reference, then timed (a peer that cannot be
    built is reported, not hidden; an optional one that does not import is skipped with a note)."""
    dtype = torch.bfloat16
    name, builder = PEERS[key]
    base: dict[str, Any] = {"peer": key, "name": name, "shape": shape.label}
    try:
        module = builder(shape, w, dtype)
    except PeerUnavailable as exc:
        print(f"note: skipping {key} at {shape.label}: {exc}")
        return {**base, "skipped": str(exc)}
    except Exception as exc:
        return {**base, "error": f"{type(exc).__name__}: {exc}"}
    x = x32.to(dtype).requires_grad_(True)
    grad = grad32.to(dtype)
    err_out, err_dx = check_peer(module, x, grad, ref)
    row: dict[str, Any] = {**base, "rel_err_out": err_out, "rel_err_dx": err_dx}
    if getattr(module, "bench_note", None):
        row["note"] = module.bench_note
    if not (err_out < TOLERANCE and err_dx < TOLERANCE):
        row["error"] = "output disagrees with the fp32 reference; not timed"
        return row
    step, clear = timed_call(module, x, grad, weights_change)
    timing = time_cuda(step, iters=iters, before=clear)
    row.update(timing)
    flops = getattr(module, "bench_flops", shape.flops)(tokens)
    row["tflops"] = flops / (timing["median_ms"] * 1e-3) / 1e12
    return row


def check_peer(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Relative errors of the output and the input gradient (a peer that times something else than
    the layer call checks itself)."""
    if getattr(module, "bench_step", None) is not None:
        module.prepare(x)
        module.bench_step()
        return module.bench_check()
    out = module(x)
    out.backward(grad)
    return rel_error(out, ref[0]), rel_error(x.grad, ref[1])


def timed_call(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, weights_change: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """What is timed (a layer call's forward + backward, or the peer's own step) and what runs
    before each timed call (gradients cleared; with ``weights_change``, new weight versions)."""
    custom = getattr(module, "bench_step", None)

    def step() -> None:
        module(x).backward(grad)

    def clear() -> None:
        x.grad = None
        module.zero_grad(set_to_none=True)
        if custom is not None:
            module.bench_clear()
        if weights_change:
            with torch.no_grad():  # an optimizer step: new weight versions (FP8 copies are remade)
                for p in module.parameters():
                    p.mul_(1.0)

    return custom or step, clear


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", action="append", help="d,h,E,k (repeatable); default: the two reference shapes")
    p.add_argument("--experts", help="expert sweep at the first shape's d,h,k, e.g. 8,16,32,64,128 (constant active parameters)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument(
        "--same-weights", action="store_true", help="keep the weights between timed calls (accumulation); default: a weight update before each"
    )
    p.add_argument("--peers", default="ours,hf,titan,sonic")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def shapes_of(args: argparse.Namespace) -> list[Shape]:
    shapes = [Shape(*map(int, s.split(","))) for s in args.shape] if args.shape else [Shape(*s) for s in REFERENCE_SHAPES]
    if args.experts:
        base = shapes[0]
        shapes = [Shape(base.d, base.h, int(e), base.top_k) for e in args.experts.split(",")]
    return shapes


def run(args: argparse.Namespace, shapes: list[Shape], peers: list[str]) -> dict[str, Any]:
    """Every peer at every shape, against the measured matmul ceiling; with --experts, each
    peer's throughput drop from the first to the last expert count."""
    device = torch.device("cuda")
    peak = matmul_peak_tflops()
    rows = []
    for shape in shapes:
        rows += run_shape(shape, args.tokens, peers, args.iters, device, not args.same_weights)
    for r in rows:
        if "tflops" in r:
            r["fraction_of_matmul_peak"] = r["tflops"] / peak
    sweep = {}
    if args.experts:
        for key in peers:
            series = [r for r in rows if r["peer"] == key and "tflops" in r]
            if len(series) >= 2:
                sweep[key] = {"first": series[0]["shape"], "last": series[-1]["shape"], "drop": 1.0 - series[-1]["tflops"] / series[0]["tflops"]}
    return {"peak": peak, "rows": rows, "sweep": sweep}


def report(args: argparse.Namespace, shapes: list[Shape], got: dict[str, Any]) -> None:
    rows, sweep = got["rows"], got["sweep"]
    print(f"bf16 matmul 8192^3 on this GPU: {got['peak']:.0f} TFLOP/s")
    print_table(rows, ["shape", "peer", "median_ms", "tflops", "fraction_of_matmul_peak", "ours_over_peer", "rel_err_out", "rel_err_dx", "error"])
    for key, s in sweep.items():
        print(f"{key}: {s['first']} -> {s['last']}: throughput drop {100 * s['drop']:.1f}%")
    payload = {
        "benchmark": "moe_layer_fwd_bwd",
        "environment": environment(),
        "config": {
            "tokens": args.tokens,
            "dtype": "bfloat16",
            "iters": args.iters,
            "warmup": 5,
            "weights_change_between_calls": not args.same_weights,
            "shapes": [dataclasses.asdict(s) for s in shapes],
            "flops_formula": "6*T*(k*3*d*h + d*E); the gemm peer: 6*T*k*3*d*h (experts only)",
        },
        "matmul_peak_tflops": got["peak"],
        "results": rows,
        "expert_sweep": sweep,
    }
    save_result("layer-sweep" if args.experts else "layer", payload, save=not args.no_save)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.layer needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = shapes_of(args)
    peers = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = set(peers) - set(PEERS)
    if unknown:
        print(f"unknown peers {sorted(unknown)}; known: {sorted(PEERS)}", file=sys.stderr)
        return 2
    got = run(args, shapes, peers)
    report(args, shapes, got)
    return 0 if all("error" not in r for r in got["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
