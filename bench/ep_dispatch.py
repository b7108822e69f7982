"""Expert-parallel dispatch + combine of one MoE layer on N local GPUs: NCCL all-to-all
dispatcher, the sync-free NVSHMEM dispatcher, and plain NCCL all_to_all_single moving the
same bytes.

    python -m bench.ep_dispatch --nproc 2
    python -m bench.ep_dispatch --nproc 2 --skew

Per rank: T tokens of width d, top-k over E experts (random routing, or --skew: every slot to
experts of rank 0). Timed: dispatch then combine (identity experts), forward alone and
forward + backward. Bytes = the rows each rank sends in dispatch and combine (2 * T * k * d *
2 B; the forward + backward moves twice that); effective GB/s = bytes / time. The NVSHMEM
outputs and gradients are checked against the NCCL dispatcher's before timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import environment, print_table, save_result, time_cuda
from moe.parallel.spawn import run_ranks


def _routing(a: dict, world: int, rank: int):
    from moe.layers.router import Routing

    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    t, e, k = a["tokens"], a["experts"], a["top_k"]
    pool = e // world if a["skew"] else e
    experts = torch.rand(t, pool, device="cuda", generator=g).topk(k, dim=-1).indices
    weights = torch.rand(t, k, device="cuda", generator=g).softmax(-1)
    flat = experts.reshape(-1)
    counts = torch.zeros(e, dtype=torch.int64, device="cuda").scatter_add_(0, flat, torch.ones_like(flat))
    zero = torch.zeros((), device="cuda")
    return Routing(experts, weights, counts, zero, zero)


class _Case:
    """One rank's inputs and both dispatchers (NCCL all-to-all, NVSHMEM symmetric)."""

    def __init__(self, a: dict, rank: int, world: int) -> None:
        import torch.distributed as dist

        from moe.parallel.expert_parallel import AllToAllDispatcher
        from moe.parallel.symmetric_dispatch import SymmetricDispatcher
        from moe.parallel.transport import build_transport

        self.group = dist.group.WORLD
        self.t, self.d, e = a["tokens"], a["d_model"], a["experts"]
        self.k = a["top_k"]
        self.routing = _routing(a, world, rank)
        self.x = torch.randn(self.t, self.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        self.probe = torch.randn(self.t, self.d, device="cuda", dtype=torch.bfloat16)
        self.nccl = AllToAllDispatcher(self.group, world, e)
        self.nvshmem = SymmetricDispatcher(self.group, world, e, build_transport(self.group, world, tuple(range(world))))

    def run(self, dispatcher, backward: bool):
        rows, _, state = dispatcher.dispatch(self.x, self.routing)
        y = dispatcher.combine(rows * 1.0, state)  # identity experts (a copy, as a GEMM would make)
        if backward:
            y.backward(self.probe)
        return y

    def check(self) -> tuple[float, float]:
        """Relative differences of the NVSHMEM dispatcher's output and input gradient from NCCL's."""
        checks = {}
        for name, disp in (("nccl", self.nccl), ("nvshmem", self.nvshmem)):
            self.x.grad = None
            checks[name] = (self.run(disp, True).detach().float(), self.x.grad.float().clone())
        err_out = ((checks["nvshmem"][0] - checks["nccl"][0]).norm() / checks["nccl"][0].norm()).item()
        err_grad = ((checks["nvshmem"][1] - checks["nccl"][1]).norm() / checks["nccl"][1].norm()).item()
        return err_out, err_grad

    def transfers(self):
        """The same bytes moved by NCCL's all_to_all_single and by the NVSHMEM transport alone
        (the two pushes a forward makes, rows already in expert order)."""
        import torch.distributed as dist

        send = torch.randn(self.t * self.k, self.d, device="cuda", dtype=torch.bfloat16)
        recv = torch.empty_like(send)

        def a2a():
            dist.all_to_all_single(recv, send, group=self.group)
            dist.all_to_all_single(send, recv, group=self.group)

        with torch.no_grad():
            _, _, st = self.nvshmem.dispatch(self.x, self.routing)
        cap = st.to_sources.rank.numel()
        rows_cap = torch.randn(cap, self.d, device="cuda", dtype=torch.bfloat16)
        tr = self.nvshmem.transport

        def pushes():
            tr.push(send, None, st.to_experts.rank, st.to_experts.row, cap, st.received)
            tr.push(rows_cap, None, st.to_sources.rank, st.to_sources.row, self.t * self.k)

        return a2a, pushes

    def profile(self, rank: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("nvshmem", lambda: self.run(self.nvshmem, True)), ("nccl", lambda: self.run(self.nccl, True))):
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            if rank == 0:
                print(f"--- profile {name} fwd+bwd x3 (rank 0)")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def _worker(rank: int, world: int, a: dict, out: str) -> None:
    """One rank: the check, the optional profile, then every timed row; rank 0 writes result.json."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    case = _Case(a, rank, world)
    err_out, err_grad = case.check()  # correctness first: outputs and input gradients of both dispatchers agree
    nbytes = 2 * case.t * case.k * case.d * 2
    a2a, pushes = case.transfers()
    if a["profile"]:
        case.profile(rank)
    results = []
    for label, fn, moved in (
        ("nccl all_to_all_single x2 (same bytes)", a2a, nbytes),
        ("nvshmem transport push x2 (same bytes)", pushes, nbytes),
        ("nccl dispatcher fwd", lambda: case.run(case.nccl, False), nbytes),
        ("nvshmem dispatcher fwd", lambda: case.run(case.nvshmem, False), nbytes),
        ("nccl dispatcher fwd+bwd", lambda: case.run(case.nccl, True), 2 * nbytes),
        ("nvshmem dispatcher fwd+bwd", lambda: case.run(case.nvshmem, True), 2 * nbytes),
    ):
        dist.barrier()
        timing = time_cuda(fn, warmup=5, iters=a["iters"])
        ms = timing["median_ms"]
        results.append({"what": label, "ms": ms, "gb_per_s": moved / (ms * 1e-3) / 1e9, "bytes": moved, **timing})
    if rank == 0:
        for r in results:
            r["bw_vs_a2a"] = r["gb_per_s"] / results[0]["gb_per_s"]
        (Path(out) / "result.json").write_text(json.dumps({"results": results, "rel_err_out": float(err_out), "rel_err_grad": float(err_grad)}))
    dist.barrier()
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GPU (bench.ep: 4 x 4096)")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--skew", action="store_true")
    p.add_argument("--profile", action="store_true", help="print a kernel profile of both dispatchers first")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def run(a: argparse.Namespace) -> dict[str, Any]:
    """The ranks' measurement: {"results": rows, "rel_err_out": ..., "rel_err_grad": ...}."""
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_worker, a.nproc, vars(a), tmp)
        return json.loads((Path(tmp) / "result.json").read_text())


def report(a: argparse.Namespace, got: dict[str, Any]) -> None:
    print(f"nvshmem vs nccl dispatcher: rel err out {got['rel_err_out']:.2e}, input grad {got['rel_err_grad']:.2e}")
    print_table(got["results"], ["what", "ms", "gb_per_s", "bw_vs_a2a"])
    payload = {"benchmark": "ep_dispatch", "environment": environment(), "config": vars(a), **got}
    save_result("ep_dispatch", payload, save=not a.no_save)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < a.nproc:
        print(f"need {a.nproc} GPUs", file=sys.stderr)
        return 2
    report(a, run(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
