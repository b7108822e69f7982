"""Row transports for the symmetric expert-parallel dispatcher: remote row writes, no host sync.

One primitive, ``push``: every rank hands in rows and, for each, a destination rank and a row
of that rank's receive buffer (``-1``: not sent); every rank gets back its receive buffer with
the rows the others (and itself) wrote. Buffer shapes are fixed and the same on every rank
(the dispatcher sizes them for the worst case), so nothing about the traffic reaches the host.

- ``NvshmemTransport`` (CUDA): receive buffers are NVSHMEM symmetric tensors allocated once
  with nvshmem4py; a Triton kernel stores each row straight into the owning GPU's buffer
  through nvshmem4py's peer tensors (NVLink loads/stores), the token gather fused in; two
  stream-ordered ``barrier_all`` calls fence it (peers done reading the previous contents;
  every row landed). torch's symmetric-memory ``all_to_all_vdev`` is not used: it wants its
  own packed layout and measured slower than NCCL here (platform notes), while plain stores
  into peer tensors beat NCCL all-to-all.
- ``EmulatedTransport`` (gloo/CPU, tests): the same buffers and layout, built by a fixed-size
  all-to-all of every rank's image of each peer's buffer (rows plus target row indices).
"""

from __future__ import annotations

import atexit
import os
from typing import Protocol

import torch
import torch.distributed as dist

from moe.kernels.routing import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _put_rows_kernel(src, src_index, dst_rank, dst_row, out, rank, D, HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
        """out[dst_row[i]] = src[src_index[i]] for the rows i with dst_rank[i] == rank; ``out``
        may be a peer GPU's memory (an NVSHMEM peer tensor)."""
        i = tl.program_id(0)
        target = tl.load(dst_rank + i)
        if target == rank:
            row = tl.load(dst_row + i).to(tl.int64)
            if HAS_INDEX:  # noqa: SIM108 - triton.jit kernel: keep the constexpr if/else as written
                s = tl.load(src_index + i).to(tl.int64)
            else:
                s = i.to(tl.int64)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < D
            v = tl.load(src + s * D + cols, mask=mask)
            tl.store(out + row * D + cols, v, mask=mask)

    @triton.jit
    def _copy_valid_rows_kernel(src, out, n_valid, D, BLOCK: tl.constexpr):
        """out[i] = src[i] for i < *n_valid (a device scalar): only the rows that arrived."""
        i = tl.program_id(0)
        if i < tl.load(n_valid):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < D
            offs = i.to(tl.int64) * D + cols
            tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy_valid_rows(src: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
    """A copy of src's first n_valid rows (count on the device); later rows unspecified."""
    out = torch.empty_like(src)
    n, d = src.shape
    if n:
        block = min(1024, triton.next_power_of_2(d))
        _copy_valid_rows_kernel[(n, triton.cdiv(d, block))](src, out, n_valid, d, BLOCK=block)
    return out


def put_rows(src: torch.Tensor, src_index: torch.Tensor | None, dst_rank: torch.Tensor, dst_row: torch.Tensor, out: torch.Tensor, rank: int) -> None:
    """The row-store kernel on one target buffer (Triton; the interpreter runs it on CPU)."""
    n, d = dst_rank.numel(), src.shape[1]
    if n == 0:
        return
    block = min(1024, triton.next_power_of_2(d))
    index = src_index if src_index is not None else dst_rank
    _put_rows_kernel[(n, triton.cdiv(d, block))](src, index, dst_rank, dst_row, out, rank, d, HAS_INDEX=src_index is not None, BLOCK=block)


class Transport(Protocol):
    ep: int
    rank: int

    def push(
        self,
        x: torch.Tensor,
        src_index: torch.Tensor | None,
        dst_rank: torch.Tensor,
        dst_row: torch.Tensor,
        n_out: int,
        n_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Row i (x[src_index[i]], or x[i]) goes to row dst_row[i] of rank dst_rank[i]'s buffer.
        Collective. Returns this rank's [n_out, D] buffer; rows nobody wrote are unspecified
        (``n_valid``, a device scalar, may say that only the first n_valid rows are written)."""
        ...


class EmulatedTransport:
    """Fixed-size all-to-all of whole buffer images over any process group (gloo on CPU)."""

    def __init__(self, group, ep: int) -> None:
        self.group, self.ep = group, ep
        self.rank = dist.get_rank(group) if group is not None else 0

    def push(self, x, src_index, dst_rank, dst_row, n_out, n_valid=None):
        rows = x if src_index is None else x.index_select(0, src_index)
        n, d = rows.shape
        peers = torch.arange(self.ep, device=x.device).unsqueeze(1)
        # target row on each peer; n_out (a trash row) where the row is not for that peer
        pos = torch.where(dst_rank.unsqueeze(0) == peers, dst_row.unsqueeze(0), n_out).contiguous()
        send = rows.unsqueeze(0).expand(self.ep, n, d).contiguous()
        got, got_pos = torch.empty_like(send), torch.empty_like(pos)
        dist.all_to_all_single(got, send, group=self.group)
        dist.all_to_all_single(got_pos, pos, group=self.group)
        out = rows.new_zeros(n_out + 1, d)
        out.index_copy_(0, got_pos.reshape(-1), got.reshape(-1, d))
        return out[:n_out]


_NV_STATE: dict = {}


def _nvshmem():
    """nvshmem4py, initialised once per process from the torch.distributed world (UID bootstrap)."""
    if "nv" in _NV_STATE:
        return _NV_STATE["nv"]
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # NVLink multicast stays off (read by nv.init)
    # The symmetric heap must hold the worst-case buffers (ep * T * k rows of d_model; 1.5 GiB at
    # the bench.ep shape); NVSHMEM's 1 GiB default is too small. Address space, mapped on use.
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "8G")
    import nvshmem.core as nv

    try:
        from cuda.core import Device
    except ImportError:  # older cuda-core
        from cuda.core.experimental import Device
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = Device(torch.cuda.current_device())
    dev.set_current()
    uid = nv.get_unique_id(empty=(rank != 0))
    objs = [uid if rank == 0 else None]
    dist.broadcast_object_list(objs, src=0)  # the UniqueID pickles; a one-off at setup
    nv.init(device=dev, uid=objs[0], rank=rank, nranks=world, initializer_method="uid")
    _NV_STATE["nv"] = nv
    _NV_STATE["transports"] = []
    atexit.register(_finalize)
    return nv


def shutdown(clean: bool = True, timeout_s: float = 60.0) -> None:
    """Free the symmetric buffers and finalize NVSHMEM while the process group still exists.

    NVSHMEM's free and finalize are collective. After a clean run every rank calls this at the
    same point (after a barrier), before torch.distributed is torn down; left to interpreter
    exit, the ranks would reach it at different times with NCCL already gone. After a failure
    (``clean=False``: this rank raised, the others may still be training) no collective is
    attempted, which could only hang: NVSHMEM is dropped and the process exit frees it. A clean
    teardown still stuck after ``timeout_s`` (the run's results are written by then) ends the
    process with status 0 and says so; an error inside it is reported and teardown goes on."""
    if "nv" not in _NV_STATE:
        return
    import sys
    import threading

    if not clean:
        _NV_STATE.pop("nv", None)
        _NV_STATE.pop("transports", None)
        atexit.unregister(_finalize)
        return

    def stuck() -> None:
        print(f"NVSHMEM teardown did not finish within {timeout_s:.0f} s; exiting without it (results are written)", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)

    timer = threading.Timer(timeout_s, stuck)
    timer.daemon = True
    timer.start()
    try:
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier()
        _finalize()
    except Exception as exc:  # noqa: BLE001 - teardown reports and goes on; the run's status stands
        print(f"warning: NVSHMEM teardown failed ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        _NV_STATE.pop("nv", None)
    finally:
        timer.cancel()
        atexit.unregister(_finalize)


def _finalize() -> None:
    nv = _NV_STATE.pop("nv", None)
    if nv is None:
        return
    try:
        torch.cuda.synchronize()
        for t in _NV_STATE.pop("transports", []):
            t.close()
        nv.finalize()
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass


def symmetric_bytes() -> int:
    """Bytes of NVSHMEM symmetric buffers this process holds (outside torch's allocator)."""
    return sum(b.numel() * b.element_size() for t in _NV_STATE.get("transports", []) for b, _ in t.buffers.values())


class NvshmemTransport:
    """Triton stores into NVSHMEM peer tensors; buffers allocated once per shape and reused
    by every layer, micro-batch and direction (all ranks allocate in the same order, as
    NVSHMEM allocation is collective)."""

    def __init__(self, group, ep: int, peer_ranks: tuple[int, ...]) -> None:
        self.group, self.ep = group, ep
        self.rank = dist.get_rank(group) if group is not None else 0
        self.peer_ranks = peer_ranks  # global (NVSHMEM PE) rank of each EP rank
        self.nv = _nvshmem()
        self.buffers: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        _NV_STATE["transports"].append(self)

    def _buffer(self, n: int, d: int, dtype: torch.dtype):
        key = (n, d, dtype)
        if key not in self.buffers:
            buf = self.nv.tensor((n, d), dtype=dtype)
            buf.zero_()
            peers = [buf if pe == dist.get_rank() else self.nv.get_peer_tensor(buf, pe) for pe in self.peer_ranks]
            self.buffers[key] = (buf, peers)
            self.nv.barrier_all(stream=torch.cuda.current_stream())
        return self.buffers[key]

    def push(self, x, src_index, dst_rank, dst_row, n_out, n_valid=None):
        x = x.contiguous()
        buf, peers = self._buffer(n_out, x.shape[1], x.dtype)
        stream = torch.cuda.current_stream()
        self.nv.barrier_all(stream=stream)  # every peer has copied out what we overwrite now
        for r, peer in enumerate(peers):
            put_rows(x, src_index, dst_rank, dst_row, peer, r)
        self.nv.barrier_all(stream=stream)  # every row for us has landed
        # autograd keeps the copy; the symmetric buffer is reused by the next call
        return buf.clone() if n_valid is None else copy_valid_rows(buf, n_valid)

    def close(self) -> None:
        for buf, _ in self.buffers.values():
            self.nv.free_tensor(buf)
        self.buffers.clear()


def build_transport(group, ep: int, peer_ranks: tuple[int, ...]) -> Transport:
    """NVSHMEM when the EP group runs on NCCL (GPUs), else the emulated transport."""
    if group is not None and dist.get_backend(group) == "nccl":
        return NvshmemTransport(group, ep, peer_ranks)
    return EmulatedTransport(group, ep)
