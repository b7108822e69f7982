"""Run under TRITON_INTERPRET=1: the weight-gradient GEMM that accumulates in its epilogue
(moe/kernels/grouped_wgrad.py) against a per-expert float64 loop, and the optimizer's gradient
sink against the separate path (torch's grouped GEMM, then an add) over micro-batches."""

import os
import sys

import torch
from torch import nn

from moe.config import OptimizerConfig
from moe.kernels import grouped_wgrad as gw
from moe.layers.experts import GroupedExperts
from moe.optim import MasterWeightAdamW


def reference(grad, x, counts):
    out, start = [], 0
    for c in counts:
        out.append(grad[start : start + c].double().t() @ x[start : start + c].double())
        start += c
    return torch.stack(out)


def check_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    counts = [7, 0, 33, 1, 20, 0]  # empty groups, a one-row group, a group longer than a block
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        for m, k, config in ((48, 40, None), (40, 264, (32, 256, 16, 4, 1))):  # the second: split epilogue
            grad = torch.randn(sum(counts), m, generator=gen).to(dtype)
            x = torch.randn(sum(counts), k, generator=gen).to(dtype)
            assert gw.supports(grad, x)
            ref = reference(grad, x, counts)
            out = torch.full((len(counts), m, k), float("nan"))
            gw.grouped_wgrad(grad, x, ends, out, accumulate=False, config=config)
            err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
            assert err < tol, (dtype, m, k, err)
            assert (out[1] == 0).all() and (out[5] == 0).all(), "an expert without rows gets zeros"
            base = torch.randn(len(counts), m, k, generator=gen)
            acc = base.clone()
            gw.grouped_wgrad(grad, x, ends, acc, accumulate=True, config=config)
            assert (acc.double() - (base.double() + ref)).abs().max().item() < tol * ref.abs().max().item() + 1e-6
            assert torch.equal(acc[1], base[1]), "accumulating leaves an empty expert's gradient as it was"
            acc16 = base.bfloat16()
            gw.grouped_wgrad(grad, x, ends, acc16, accumulate=True, config=config)
            want = (base.bfloat16().float().double() + ref).bfloat16().double()  # one rounding
            assert (acc16.double() - want).abs().max().item() <= 2**-7 * want.abs().max().item()
    try:
        gw.grouped_wgrad(grad, x, ends, torch.zeros(len(counts), 3, k), accumulate=False)
    except ValueError as exc:
        assert "grouped_wgrad" in str(exc)
    else:
        raise AssertionError("a mismatched accumulator was taken")
    try:
        gw.grouped_wgrad(grad, x, ends, torch.zeros(len(counts), m, k, dtype=torch.float16), accumulate=False)
    except ValueError as exc:
        assert "fp32 or bf16" in str(exc)
    else:
        raise AssertionError("an fp16 accumulator was taken")


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = GroupedExperts(4, 32, 16)
        self.experts.reset_parameters(0.5)


def train(wgrad: str, accum: str, micro_batches: list) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = Experts().bfloat16()
    opt = MasterWeightAdamW(model, OptimizerConfig(expert_grad_accum=accum, expert_wgrad=wgrad), master_weights=True)
    calls = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda t: calls.append(t))
    for i, (x, counts) in enumerate(micro_batches):
        if i == len(micro_batches) - 1:
            opt.last_micro_batch()
        out = model.experts(x, counts)
        (out.float() ** 2).sum().backward()
    opt.fold_deferred()
    for p in model.parameters():
        assert p.grad is None, "every expert gradient reached its fp32 holder"
    return [p.grad.clone() for p in opt.params], len(calls)


def check_optimizer_sink() -> None:
    gen = torch.Generator().manual_seed(1)
    micro = []
    for counts in ([5, 0, 9, 2], [3, 6, 0, 7], [8, 1, 1, 4]):
        c = torch.tensor(counts)
        micro.append((torch.randn(int(c.sum()), 32, generator=gen).bfloat16(), c))
    for accum in ("fp32", "bf16"):
        fused, fused_calls = train("gemm", accum, micro)
        separate, separate_calls = train("separate", accum, micro)
        assert fused_calls == separate_calls == 2 * len(micro), (fused_calls, separate_calls)
        for a, b in zip(fused, separate, strict=True):
            assert a.dtype == torch.float32
            # the separate path rounds each micro-batch's gradient to bf16 before adding it
            err = ((a - b).norm() / b.norm()).item()
            assert err < 1e-2, (accum, err)


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    check_kernel()
    check_optimizer_sink()
    print("grouped wgrad ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
