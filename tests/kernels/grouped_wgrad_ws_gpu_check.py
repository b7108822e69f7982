"""Run on an sm90 GPU (Gluon has no interpreter): the warp-specialised wgrad kernel
(moe/kernels/grouped_wgrad_ws.py), in each of its tile configs, against a per-expert float64
loop and against the Triton kernel, at awkward row counts (empty experts, one row, rows past a block, a
run of empty experts between long ones), accumulating and not, into fp32 and bf16, in index
order and heaviest first; then twice over to show it is deterministic, and at the step's shapes;
and paired (optim.expert_wgrad=paired: a second micro-batch's rows in the same sum) the same ways; each
case also with ``squares=True`` (the row sums of squares the gradient norm reads) against float64.

    python tests/kernels/grouped_wgrad_ws_gpu_check.py   # exits non-zero on any failure
"""

import sys

import torch

from moe.kernels import grouped_wgrad as gw
from moe.kernels import grouped_wgrad_ws as ws
from tests.kernels.grouped_wgrad_check import reference  # the per-expert float64 loop


def case(counts, m, k, out_dtype, ordered, gen, config=None, counts2=None) -> list[str]:
    """counts2: a second micro-batch's rows per expert, summed in the same GEMM (paired)."""
    failures = []
    ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    grad = torch.randn(sum(counts), m, generator=gen, device="cuda").bfloat16()
    x = torch.randn(sum(counts), k, generator=gen, device="cuda").bfloat16()
    ref = reference(grad, x, counts)
    pair = None
    if counts2 is not None:
        pair = (
            torch.randn(sum(counts2), m, generator=gen, device="cuda").bfloat16(),
            torch.randn(sum(counts2), k, generator=gen, device="cuda").bfloat16(),
            torch.tensor(counts2, device="cuda").cumsum(0).to(torch.int32),
        )
        ref = ref + reference(pair[0], pair[1], counts2)
    scale = ref.abs().max().item()
    shown = counts if len(counts) < 9 else f"{len(counts)} experts"
    label = f"counts={shown}{' paired' if pair else ''} m={m} k={k} out={out_dtype} ordered={ordered} config={config}"
    if not ws.supports(grad, x, torch.empty(len(counts), m, k, dtype=out_dtype, device="cuda"), pair=pair):
        return [f"{label}: not supported"]
    for accumulate in (False, True):
        base = torch.randn(len(counts), m, k, generator=gen, device="cuda").to(out_dtype)
        got = base.clone() if accumulate else torch.full_like(base, float("nan"))
        want = base.clone() if accumulate else torch.full_like(base, float("nan"))
        gw.grouped_wgrad(grad, x, ends, got, accumulate=accumulate, ordered=ordered, kernel="ws", ws_config=config, pair=pair)
        gw.grouped_wgrad(grad, x, ends, want, accumulate=accumulate, ordered=ordered, kernel="triton", pair=pair)
        torch.cuda.synchronize()
        expect = (base.double() if accumulate else 0) + ref
        tol = 1e-5 * scale + 1e-6 if out_dtype == torch.float32 else 2**-7 * expect.abs().max().item()
        err = (got.double() - expect).abs().max().item()
        same = torch.equal(got, want)
        print(f"{label} accumulate={accumulate}: max err {err:.3g} (tol {tol:.3g}), bitwise as the Triton kernel: {same}")
        if not err <= tol:
            failures.append(f"{label} accumulate={accumulate}: err {err}")
        if not same:
            failures.append(f"{label} accumulate={accumulate}: not the Triton kernel's bits")
        empty = [g for g, c in enumerate(counts) if c == 0 and (counts2 is None or counts2[g] == 0)]
        if empty and accumulate and not torch.equal(got[empty], base[empty]):
            failures.append(f"{label}: an empty expert's sum changed")
        if empty and not accumulate and not (got[empty] == 0).all():
            failures.append(f"{label}: an empty expert did not get zeros")
        # squares=True (the gradient norm from the epilogue): the same sums, and row sums of squares of them
        with_sq = base.clone() if accumulate else torch.full_like(base, float("nan"))
        sq = gw.grouped_wgrad(grad, x, ends, with_sq, accumulate=accumulate, ordered=ordered, kernel="ws", ws_config=config, pair=pair, squares=True)
        rows = with_sq.double().square().sum(2)
        sq_err = (sq.double().sum(2) - rows).abs().max().item()
        if not torch.equal(with_sq, got):
            failures.append(f"{label} accumulate={accumulate}: the sums change when the squares are asked for")
        if not sq_err <= 1e-5 * rows.max().item():
            failures.append(f"{label} accumulate={accumulate}: row sums of squares off by {sq_err} (of {rows.max().item()})")
        again = base.clone() if accumulate else torch.full_like(base, float("nan"))
        gw.grouped_wgrad(grad, x, ends, again, accumulate=accumulate, ordered=ordered, kernel="ws", ws_config=config, pair=pair)
        if not torch.equal(again, got):
            failures.append(f"{label} accumulate={accumulate}: a rerun differs")
    return failures


def main() -> int:
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        print("needs an sm90 GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    failures = []
    small = [7, 0, 33, 1, 200, 0, 0, 0, 64, 129]
    for config in ws.CONFIGS.values():
        for out_dtype in (torch.float32, torch.bfloat16):
            for ordered in (False, True):
                failures += case(small, 256, 384, out_dtype, ordered, gen, config)
        failures += case([300] * 7, 128, 256, torch.float32, True, gen, config)  # an odd tile count per program
        # 160 tiles over the SMs (some programs take two), mains loops long enough that a slot goes back late
        medium = [0 if e % 9 == 4 else 600 + 37 * e for e in range(40)]
        failures += case(medium, 256, 512, torch.float32, True, gen, config)
    failures += case(small, 128, 200, torch.float32, True, gen)  # K not a multiple of the tile: clipped by TMA
    # the step's shapes: Qwen-like gate_up and down (128 experts, 16,384 tokens x top-8), OLMoE width
    counts = torch.multinomial(torch.ones(128), 16384 * 8, replacement=True, generator=torch.Generator().manual_seed(1)).bincount(minlength=128)
    failures += case(counts.tolist(), 1536, 2048, torch.float32, True, gen)
    failures += case(counts.tolist(), 2048, 768, torch.float32, True, gen)
    counts = torch.multinomial(torch.ones(64), 16384 * 8, replacement=True, generator=torch.Generator().manual_seed(2)).bincount(minlength=64)
    failures += case(counts.tolist(), 2048, 2048, torch.float32, True, gen)
    # paired: empty in one micro-batch only, in both, one row against a long run; fp32 and bf16, both orders
    small2 = [0, 5, 40, 0, 1, 0, 300, 2, 0, 64]
    for config in ws.CONFIGS.values():
        for out_dtype in (torch.float32, torch.bfloat16):
            for ordered in (False, True):
                failures += case(small, 256, 384, out_dtype, ordered, gen, config, counts2=small2)
        failures += case(medium, 256, 512, torch.float32, True, gen, config, counts2=medium[::-1])
    counts2 = torch.multinomial(torch.ones(64), 16384 * 8, replacement=True, generator=torch.Generator().manual_seed(3)).bincount(minlength=64)
    failures += case(counts.tolist(), 2048, 2048, torch.float32, True, gen, counts2=counts2.tolist())  # the paired step's gate_up
    failures += case(counts.tolist(), 2048, 1024, torch.float32, True, gen, counts2=counts2.tolist())  # and its down
    for f in failures:
        print("FAIL", f)
    print("ok" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
