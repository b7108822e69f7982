"""Run under TRITON_INTERPRET=1: the weight-gradient GEMM that accumulates in its epilogue
(moe/kernels/grouped_wgrad.py) against a per-expert float64 loop, and the optimizer's gradient
sink against the separate path (torch's grouped GEMM, then an add) over micro-batches, with the
bf16 expert GEMM and with the FP8 one (whose wgrad the sink takes in bf16, on expert-ordered and
on token rows)."""

import os
import sys
from types import SimpleNamespace

import torch
from torch import nn

from moe.config import OptimizerConfig
from moe.kernels import grouped_wgrad as gw
from moe.layers.experts import GroupedExperts
from moe.layers.gemm_fp8 import Fp8GroupedGemm
from moe.nn.fp8_policy import Fp8Gemms, Fp8Rule
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


def check_expert_order_and_tile_orders() -> None:
    """The device ranking against torch's stable sort (ties, empty experts, more experts than a
    ranking block); the kernel's results bitwise the same with the experts in index order and
    heaviest first, writing and accumulating (each tile's sum does not depend on when it runs)."""
    gen = torch.Generator().manual_seed(3)
    for counts in ([7, 0, 33, 1, 20, 0, 33], [0] * 5, torch.randint(0, 4, (300,), generator=gen).tolist()):
        c = torch.tensor(counts)
        ends = c.cumsum(0).to(torch.int32)
        want = torch.sort(c, descending=True, stable=True).indices.to(torch.int32)
        assert torch.equal(gw.expert_order(ends), want), counts
    counts = [7, 0, 33, 1, 20, 0, 33]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    grad = torch.randn(sum(counts), 24, generator=gen).bfloat16()
    x = torch.randn(sum(counts), 40, generator=gen).bfloat16()
    base = torch.randn(len(counts), 24, 40, generator=gen)
    for accumulate in (False, True):
        got = []
        for ordered in (False, True):
            out = base.clone()
            gw.grouped_wgrad(grad, x, ends, out, accumulate=accumulate, ordered=ordered)
            got.append(out)
        assert torch.equal(got[0], got[1]), accumulate
    # a pair (optim.expert_wgrad=paired): a second micro-batch's rows in the same sum, ranked by both
    counts2 = [0, 5, 2, 40, 0, 0, 1]
    ends2 = torch.tensor(counts2).cumsum(0).to(torch.int32)
    total = torch.tensor(counts) + torch.tensor(counts2)
    assert torch.equal(gw.expert_order(ends, ends2), torch.sort(total, descending=True, stable=True).indices.to(torch.int32))
    grad2 = torch.randn(sum(counts2), 24, generator=gen).bfloat16()
    x2 = torch.randn(sum(counts2), 40, generator=gen).bfloat16()
    want = reference(grad, x, counts) + reference(grad2, x2, counts2)
    for accumulate in (False, True):
        out = base.clone()
        gw.grouped_wgrad(grad, x, ends, out, accumulate=accumulate, pair=(grad2, x2, ends2))
        expect = want + base.double() if accumulate else want
        assert (out.double() - expect).abs().max().item() < 1e-5 * expect.abs().max().item(), accumulate
        assert not accumulate or torch.equal(out[5], base[5]), "an expert empty in both micro-batches is left as it was"


def check_squares() -> None:
    """``squares=True``: the partial sums add up to the sum of squares of the accumulator after
    the call (row by row, within fp32 rounding), writing and accumulating, alone and paired, into
    fp32 and bf16, with experts empty in one micro-batch, in both, and rows past a tile (M and K
    not multiples of the interpreter's 32)."""
    gen = torch.Generator().manual_seed(5)
    counts, counts2 = [7, 0, 33, 1, 20, 0, 33], [0, 5, 2, 40, 0, 0, 1]
    m, k = 40, 72
    ends, ends2 = (torch.tensor(c).cumsum(0).to(torch.int32) for c in (counts, counts2))
    grad, x = torch.randn(sum(counts), m, generator=gen).bfloat16(), torch.randn(sum(counts), k, generator=gen).bfloat16()
    grad2, x2 = torch.randn(sum(counts2), m, generator=gen).bfloat16(), torch.randn(sum(counts2), k, generator=gen).bfloat16()
    for dtype in (torch.float32, torch.bfloat16):
        for pair in (None, (grad2, x2, ends2)):
            for accumulate in (False, True):
                out = torch.randn(len(counts), m, k, generator=gen).to(dtype)
                sq = gw.grouped_wgrad(grad, x, ends, out, accumulate=accumulate, pair=pair, squares=True)
                rows = out.double().square().sum(2)
                assert sq.dtype == torch.float32 and sq.shape[:2] == rows.shape, (sq.dtype, sq.shape)
                err = (sq.double().sum(2) - rows).abs().max().item()
                assert err <= 1e-5 * rows.max().item(), (dtype, pair is not None, accumulate, err)
                assert gw.grouped_wgrad(grad, x, ends, out.clone(), accumulate=accumulate, pair=pair) is None, "no squares unless asked"


def check_fp8_kernel() -> None:
    """The FP8 kernel on quantize_cols_grouped's padded operands against the dequantised
    operands multiplied per expert in float64 (the kernel's only error is its fp32 sum)."""
    from moe.kernels.fp8 import quantize_cols_grouped

    gen = torch.Generator().manual_seed(2)
    counts = [7, 0, 33, 1, 20, 0]
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    for m, k, config in ((48, 40, None), (40, 264, (32, 256, 16, 4, 1))):
        grad = torch.randn(sum(counts), m, generator=gen).bfloat16()
        x = (torch.randn(sum(counts), k, generator=gen) * 100).bfloat16()
        gt, sg, padded = quantize_cols_grouped(grad, ends, pad=True)
        xt, sx, _ = quantize_cols_grouped(x, ends, pad=True)
        ref, start = [], 0
        for g, end in enumerate(padded.tolist()):
            a = gt[:, start:end].double() * sg.view(len(counts), m)[g].double()[:, None]
            b = xt[:, start:end].double() * sx.view(len(counts), k)[g].double()[:, None]
            ref.append(a @ b.t())
            start = end
        ref = torch.stack(ref)
        exact = reference(grad, x, counts)
        assert ((ref - exact).norm() / exact.norm()).item() < 0.05, "the quantised operands are the rows"
        for acc_dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
            base = torch.randn(len(counts), m, k, generator=gen).to(acc_dtype)
            fresh = torch.full_like(base, float("nan"))
            gw.grouped_wgrad_fp8(gt, sg, xt, sx, padded, fresh, accumulate=False, config=config)
            assert ((fresh.double() - ref).abs().max() / ref.abs().max()).item() < tol, (m, k, acc_dtype)
            assert (fresh[1] == 0).all() and (fresh[5] == 0).all(), "an expert without rows gets zeros"
            acc = base.clone()
            gw.grouped_wgrad_fp8(gt, sg, xt, sx, padded, acc, accumulate=True, config=config)
            want = base.double() + ref
            assert ((acc.double() - want).abs().max() / want.abs().max()).item() < tol, (m, k, acc_dtype)
            assert torch.equal(acc[1], base[1]), "accumulating leaves an empty expert's gradient as it was"
    try:
        gw.grouped_wgrad_fp8(gt, sg, xt, sx, padded, torch.zeros(len(counts), m + 1, k), accumulate=False)
    except ValueError as exc:
        assert "grouped_wgrad_fp8" in str(exc)
    else:
        raise AssertionError("a mismatched accumulator was taken")


class Experts(nn.Module):
    def __init__(self, gemm=None) -> None:
        super().__init__()
        self.experts = GroupedExperts(4, 32, 16, gemm)
        self.experts.reset_parameters(0.5)


class Bf16Wgrad(Fp8Rule):
    """Forward and dgrad in FP8, wgrad in bf16 (what the sink computes)."""

    def plan(self, tokens, groups, out_dim, in_dim) -> Fp8Gemms:
        return Fp8Gemms(fwd=True, dgrad=True, wgrad=False)


def train(
    wgrad: str, accum: str, micro_batches: list, gemm=None, token_rows: bool = False, keep: list | None = None
) -> tuple[list[torch.Tensor], int, int]:
    """(fp32 gradients, post-accumulate hook calls, accumulating-kernel launches); ``keep``: the
    optimizer appended to it."""
    torch.manual_seed(0)
    model = Experts(gemm).bfloat16()
    opt = MasterWeightAdamW(model, OptimizerConfig(expert_grad_accum=accum, expert_wgrad=wgrad), master_weights=True)
    for w in (model.experts.gate_up, model.experts.down):  # what PrecisionRecipe.attach_optimizer does, without a release
        model.experts.gemm.bind(w, sink=opt.bind_expert(w))
    calls, launches = [], []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda t: calls.append(t))
    kernel, fp8_kernel = gw.grouped_wgrad, gw.grouped_wgrad_fp8
    gw.grouped_wgrad = lambda *a, **k: (launches.append("bf16"), kernel(*a, **k))[1]  # counts, then runs the real kernel
    gw.grouped_wgrad_fp8 = lambda *a, **k: (launches.append("fp8"), fp8_kernel(*a, **k))[1]
    try:
        for i, (x, counts, routing) in enumerate(micro_batches):
            if i == len(micro_batches) - 1:
                opt.last_micro_batch()
            out = model.experts.forward_tokens(x, routing, counts) if token_rows else model.experts(x, counts)
            (out.float() ** 2).sum().backward()
    finally:
        gw.grouped_wgrad, gw.grouped_wgrad_fp8 = kernel, fp8_kernel
    opt.fold_deferred()
    for p in model.parameters():
        assert p.grad is None, "every expert gradient reached its fp32 holder"
    if keep is not None:
        keep.append(opt)
    return [p.grad.clone() for p in opt.params], len(calls), launches


def _micro_batches(top_k: int = 2) -> list:
    """Expert-ordered rows with their counts, and for token rows the routing of T = rows / k
    tokens (order, inverse, weights) that sends the same number of rows to each expert."""
    gen = torch.Generator().manual_seed(1)
    micro = []
    for counts in ([6, 0, 10, 2], [4, 6, 0, 8], [8, 2, 2, 4]):
        c = torch.tensor(counts)
        rows = int(c.sum())
        expert_of_slot = torch.repeat_interleave(torch.arange(4), c)[torch.randperm(rows, generator=gen)]
        order = torch.argsort(expert_of_slot, stable=True)
        routing = SimpleNamespace(order=order, inverse=torch.argsort(order), weights=torch.rand(rows // top_k, top_k, generator=gen).bfloat16())
        micro.append((torch.randn(rows, 32, generator=gen).bfloat16(), c, routing))
    return micro


def check_optimizer_sink() -> None:
    micro = _micro_batches()
    for accum in ("fp32", "bf16"):
        fused, fused_calls, launches = train("gemm", accum, micro)
        separate, separate_calls, _ = train("separate", accum, micro)
        assert fused_calls == separate_calls == 2 * len(micro), (fused_calls, separate_calls)
        assert launches == ["bf16"] * 2 * len(micro), launches
        for a, b in zip(fused, separate, strict=True):
            assert a.dtype == torch.float32
            # the separate path rounds each micro-batch's gradient to bf16 before adding it
            err = ((a - b).norm() / b.norm()).item()
            assert err < 1e-2, (accum, err)


def check_sink_squares() -> None:
    """MOE_EXPERT_GRAD_SQUARES=epilogue: the sink keeps the sums of squares its last GEMM
    reported (at the step's last micro-batch: not those of an earlier GEMM, which later ones
    made stale), and the norm over them equals the norm that reads every gradient; none kept
    with the switch off, and none after zero_grad."""
    import moe.optim
    from moe.parallel.grad_sync import global_grad_norm

    micro = _micro_batches()
    saved = moe.optim.EPILOGUE_SQUARES
    try:
        for on in (True, False):
            moe.optim.EPILOGUE_SQUARES = on
            for wgrad, accum in (("gemm", "fp32"), ("paired", "fp32"), ("gemm", "bf16")):
                for n in (1, 2, 3):  # one micro-batch, a pair, a pair and one left for the last
                    keep: list = []
                    grads, _, _ = train(wgrad, accum, micro[:n], keep=keep)
                    opt = keep[0]
                    known = opt.grad_squares()
                    experts = [p.grad for p in opt.params if p.expert]
                    assert len(known) == (len(experts) if on else 0), (on, wgrad, accum, n, len(known))
                    if on:
                        assert all(id(g) in known for g in experts)
                        want = global_grad_norm(opt.grads(), torch.device("cpu")).item()
                        got = global_grad_norm(opt.grads(), torch.device("cpu"), known).item()
                        assert abs(got - want) <= 1e-6 * want, (wgrad, accum, n, got, want)
                    opt.zero_grad()
                    assert not opt.grad_squares()
    finally:
        moe.optim.EPILOGUE_SQUARES = saved


def check_fp8_sink() -> None:
    """The FP8 expert GEMM with a sink: wgrad in the FP8 accumulating GEMM where the rule sends
    wgrad to FP8 (the same quantised operands as the separate FP8 path, whose bf16 result is then
    added), in the bf16 one where it keeps wgrad in bf16, on expert-ordered and on token rows."""
    micro = _micro_batches()
    for token_rows in (False, True):
        all_fp8, calls, launches = train("gemm", "fp32", micro, Fp8GroupedGemm(Fp8Rule(0), emulate=True), token_rows)
        assert launches == ["fp8"] * 2 * len(micro) and calls == 2 * len(micro), (token_rows, launches, calls)
        fp8_separate, _, none = train("separate", "fp32", micro, Fp8GroupedGemm(Fp8Rule(0), emulate=True), token_rows)
        assert none == []
        kept, _, launches = train("gemm", "fp32", micro, Fp8GroupedGemm(Bf16Wgrad(0), emulate=True), token_rows)
        assert launches == ["bf16"] * 2 * len(micro), launches
        separate, _, none = train("separate", "fp32", micro, Fp8GroupedGemm(Bf16Wgrad(0), emulate=True), token_rows)
        assert none == []
        for a, b in ((all_fp8, fp8_separate), (kept, separate)):
            for x, y in zip(a, b, strict=True):
                err = ((x - y).norm() / y.norm()).item()
                assert err < 1e-2, (token_rows, err)  # the separate paths round each micro-batch's gradient to bf16
        for x, y in zip(all_fp8, kept, strict=True):
            assert not torch.equal(x, y), "FP8 wgrad ran"
            assert ((x - y).norm() / y.norm()).item() < 0.1, token_rows


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    check_kernel()
    check_expert_order_and_tile_orders()
    check_squares()
    check_fp8_kernel()
    check_optimizer_sink()
    check_sink_squares()
    check_fp8_sink()
    print("grouped wgrad ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
