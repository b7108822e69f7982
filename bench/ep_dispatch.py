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
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.common import environment, print_table, time_cuda, write_result
from moe.parallel.env import free_port


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


def _worker(rank: int, world: int, port: int, a: dict, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch.distributed as dist

    from moe.parallel.expert_parallel import AllToAllDispatcher
    from moe.parallel.symmetric_dispatch import SymmetricDispatcher
    from moe.parallel.transport import build_transport

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    t, d, e, k = a["tokens"], a["d_model"], a["experts"], a["top_k"]
    routing = _routing(a, world, rank)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probe = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    nccl = AllToAllDispatcher(group, world, e)
    nvshmem = SymmetricDispatcher(group, world, e, build_transport(group, world, tuple(range(world))))

    def run(dispatcher, backward: bool):
        rows, _, state = dispatcher.dispatch(x, routing)
        y = dispatcher.combine(rows * 1.0, state)  # identity experts (a copy, as a GEMM would make)
        if backward:
            y.backward(probe)
        return y

    # correctness first: outputs and input gradients of both dispatchers agree
    checks = {}
    for name, disp in (("nccl", nccl), ("nvshmem", nvshmem)):
        x.grad = None
        checks[name] = (run(disp, True).detach().float(), x.grad.float().clone())
    err_out = ((checks["nvshmem"][0] - checks["nccl"][0]).norm() / checks["nccl"][0].norm()).item()
    err_grad = ((checks["nvshmem"][1] - checks["nccl"][1]).norm() / checks["nccl"][1].norm()).item()

    nbytes = 2 * t * k * d * 2
    send = torch.randn(t * k, d, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(send)

    def a2a():
        dist.all_to_all_single(recv, send, group=group)
        dist.all_to_all_single(send, recv, group=group)

    # the transport alone: the same two pushes a forward makes, rows already in expert order
    with torch.no_grad():
        _, _, st = nvshmem.dispatch(x, routing)
    cap = st.to_sources.rank.numel()
    rows_cap = torch.randn(cap, d, device="cuda", dtype=torch.bfloat16)
    tr = nvshmem.transport

    def pushes():
        tr.push(send, None, st.to_experts.rank, st.to_experts.row, cap, st.received)
        tr.push(rows_cap, None, st.to_sources.rank, st.to_sources.row, t * k)

    if a["profile"]:
        from torch.profiler import ProfilerActivity, profile

        for name, fn in (("nvshmem", lambda: run(nvshmem, True)), ("nccl", lambda: run(nccl, True))):
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
            if rank == 0:
                print(f"--- profile {name} fwd+bwd x3 (rank 0)")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))

    results = []
    for label, fn, moved in (
        ("nccl all_to_all_single x2 (same bytes)", a2a, nbytes),
        ("nvshmem transport push x2 (same bytes)", pushes, nbytes),
        ("nccl dispatcher fwd", lambda: run(nccl, False), nbytes),
        ("nvshmem dispatcher fwd", lambda: run(nvshmem, False), nbytes),
        ("nccl dispatcher fwd+bwd", lambda: run(nccl, True), 2 * nbytes),
        ("nvshmem dispatcher fwd+bwd", lambda: run(nvshmem, True), 2 * nbytes),
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


def main(argv: list[str] | None = None) -> int:
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
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < a.nproc:
        print(f"need {a.nproc} GPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(a.nproc, free_port(), vars(a), tmp), nprocs=a.nproc, join=True, start_method="spawn")
        got = json.loads((Path(tmp) / "result.json").read_text())
    rows = got["results"]
    print(f"nvshmem vs nccl dispatcher: rel err out {got['rel_err_out']:.2e}, input grad {got['rel_err_grad']:.2e}")
    print_table(rows, ["what", "ms", "gb_per_s", "bw_vs_a2a"])
    payload = {"benchmark": "ep_dispatch", "environment": environment(), "config": vars(a), **got}
    if not a.no_save:
        print(f"wrote {write_result('ep_dispatch', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
