"""The training step replayed as one CUDA graph: what launching from Python costs the step.

    python -m bench.graph_step --layers 8 --micro 4 --accum 4 --warmup 2 --steps 8
    python -m bench.graph_step --layers 8 --micro 4 --accum 4 --expert-wgrad paired

bench.model times ``Trainer.train_step`` as training runs it: Python launches every kernel, and
where the host falls behind, the GPU idles (11-18 ms a step in the profiles, 2-4% of it). Here the
same trainer, in the same process, first runs its steps eagerly (timed synchronised and back to back,
as bench.model does), then captures one whole step (every micro-batch's forward and backward, the
gradient norm, the AdamW step) into a CUDA graph and replays it, copying each step's micro-batches
into the graph's static device inputs first. The ratio of the two timings is the size of the lever
before any of it is built into the trainer. The learning rate of every replay is the captured step's
(``schedule.decay`` is set constant here, so eager and graphed steps use the same one).

Before timing, a two-layer model trained eagerly and a twin trained by graph replays (same seed,
same data) must give the same losses to 1e-3 relative (``--check-layers``; on an H100 they agree to
about 1e-5, not bitwise); the timed run's replay losses are printed beside the eager ones. Same
FLOP formula, peak and routing as bench.model (learned, dropless).
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import environment, matmul_peak_tflops, pipelined_train_steps, print_table, save_result, timed_train_steps
from bench.model import _planned_peak, build_config, make_data, parse_args, sdpa_backend
from moe.hardware import configure_cuda_allocator
from moe.plan.accounting import flops_per_token
from moe.train.trainer import Trainer


class GraphedStep:
    """One captured ``trainer.train_step()``; ``replay()`` feeds the loader's next micro-batches
    into the static inputs (stream-ordered copies) and launches the graph."""

    def __init__(self, trainer: Trainer, side_warmup: int = 2) -> None:
        self.trainer = trainer
        self.next_batch = trainer.loader.next_batch
        device = torch.device("cuda")
        self.inputs = [b.to(device) for b in self.next_batch()]  # the first warm-up step's batch
        trainer.loader.next_batch = lambda: self.inputs  # the step reads the static inputs
        torch.set_autocast_cache_enabled(False)  # required inside a capture
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager steps' cached blocks back, for the graph's pool
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # lazy state (autotuning, workspaces) before capture
            for i in range(side_warmup):
                if i:
                    self._feed()
                trainer.train_step()
                trainer.step += 1
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the side stream's cached blocks too: the capture's pool needs them
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):  # (the loader's threads)
            trainer.train_step()
        self.loss = trainer._pending[-1][1]  # rewritten by every replay
        torch.cuda.synchronize()

    def close(self) -> None:
        """Give the loader back and drop the graph (its private memory pool goes with it once the
        trainer is dropped: the loader's hook into this object is the cycle that would keep both)."""
        self.trainer.loader.next_batch = self.next_batch
        del self.graph, self.inputs, self.loss

    def _feed(self) -> None:
        for dst, src in zip(self.inputs, self.next_batch(), strict=True):
            dst.copy_(src.pin_memory(), non_blocking=True)

    def replay(self) -> torch.Tensor:
        """One training step; its loss (a device copy, no sync)."""
        self._feed()
        self.graph.replay()
        self.trainer.step += 1
        return self.loss.clone()


def timed_replays(step: GraphedStep, steps: int) -> tuple[list[float], list[float], list[torch.Tensor]]:
    """(synchronised step times, back-to-back step times, losses), as bench.common times eager steps."""
    synced, losses = [], []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(step.replay())
        end.record()
        torch.cuda.synchronize()
        synced.append(start.elapsed_time(end) / 1e3)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for i in range(steps):
        losses.append(step.replay())
        marks[i + 1].record()
    torch.cuda.synchronize()
    return synced, [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(steps)], losses


def _config(args, tmp: Path, steps: int, layers: int | None = None):
    data = tmp / f"tokens-{layers}"
    data.mkdir()
    make_data(data, (args.seq + 1) * args.micro * args.accum * (steps + 2), 50304)
    if layers is not None:
        args = type(args)(**{**vars(args), "layers": layers})
    cfg = build_config(args, data, tmp / f"ck{layers}", steps)
    cfg.schedule.decay = "constant"  # every step at the captured step's learning rate
    cfg.validate()
    return cfg


def _release() -> None:
    """Free what a dropped trainer held (collected, not just unreferenced) and return it to the GPU,
    so the timed run starts with the memory it would have alone."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def check_bitwise(args, tmp: Path, layers: int, steps: int = 4) -> dict[str, Any]:
    """Eager against graph-replayed training of a small twin: losses over ``steps`` steps after
    the capture (the graphed twin's side-stream warm-up steps are eager steps too)."""
    cfg = _config(args, tmp, 2 + steps + 2, layers)
    eager = Trainer(cfg)
    for _ in range(2 + steps):
        eager.train_step()
        eager.step += 1
    want = torch.stack([v for _, v in eager._pending][2:]).tolist()
    del eager
    _release()
    twin = Trainer(cfg)
    graphed = GraphedStep(twin, side_warmup=2)
    got = torch.stack([graphed.replay() for _ in range(steps)]).tolist()  # the capture runs nothing
    graphed.close()
    del graphed, twin
    _release()
    worst = max(abs(a - b) / abs(a) for a, b in zip(want, got, strict=True))
    return {"layers": layers, "eager": want, "graphed": got, "bitwise": want == got, "max_rel_diff": worst}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    check_layers = 2
    if "--check-layers" in argv:
        i = argv.index("--check-layers")
        check_layers = int(argv[i + 1])
        del argv[i : i + 2]
    args = parse_args(argv)
    configure_cuda_allocator()
    if not torch.cuda.is_available():
        print("bench.graph_step needs a CUDA GPU", file=sys.stderr)
        return 2
    peak_measured = matmul_peak_tflops()
    with tempfile.TemporaryDirectory() as tmp_name, sdpa_backend(args.sdpa):
        tmp = Path(tmp_name)
        check = check_bitwise(args, tmp, check_layers)
        print(
            f"{check_layers} layers, eager vs graph replays: losses bitwise equal {check['bitwise']}, "
            f"largest relative difference {check['max_rel_diff']:.2e}"
        )
        print(f"  eager   {check['eager']}\n  graphed {check['graphed']}")
        print(f"after the check: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated")
        total = args.warmup + 2 * args.steps + 2 + 2 * args.steps + 2
        cfg = _config(args, tmp, total)
        trainer = Trainer(cfg)
        for _ in range(args.warmup):
            trainer.train_step()
            trainer.step += 1
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        eager = timed_train_steps(trainer, args.steps)
        eager_losses = torch.stack([v for _, v in trainer._pending][-args.steps :]).tolist()
        eager_pipe = pipelined_train_steps(trainer, args.steps)
        eager_peak = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        graphed = GraphedStep(trainer)
        synced, pipe, losses = timed_replays(graphed, args.steps)
        graph_peak = torch.cuda.max_memory_allocated() / 2**30
        graph_losses = torch.stack(losses).tolist()
    fpt = flops_per_token(cfg.model, args.seq)
    tokens = args.micro * args.accum * args.seq

    def row(mode: str, times: list[float], back_to_back: list[float], peak_gib: float) -> dict[str, Any]:
        step, b2b = statistics.median(times), statistics.median(back_to_back)
        tflops = tokens * fpt / step / 1e12
        return {
            "mode": mode,
            "layers": args.layers,
            "expert_wgrad": args.expert_wgrad,
            "tokens_per_step": tokens,
            "step_s": step,
            "step_s_pipelined": b2b,
            "tflops": tflops,
            "mfu_measured_peak": tflops / peak_measured,
            "mfu_measured_peak_pipelined": tokens * fpt / b2b / 1e12 / peak_measured,
            "peak_mem_gib": peak_gib,
        }

    rows = [row("eager", eager, eager_pipe, eager_peak), row("cuda_graph", synced, pipe, graph_peak)]
    print(f"bf16 matmul 8192^3 on this GPU: {peak_measured:.0f} TFLOP/s")
    print_table(rows, list(rows[0]))
    print(
        f"graphed / eager step time: {rows[1]['step_s'] / rows[0]['step_s']:.4f} synchronised, "
        f"{rows[1]['step_s_pipelined'] / rows[0]['step_s_pipelined']:.4f} back to back"
    )
    print(f"eager losses   {[round(v, 4) for v in eager_losses]}\ngraphed losses {[round(v, 4) for v in graph_losses]}")
    payload = {
        "benchmark": "train_step_cuda_graph",
        "environment": environment(),
        "config": {**vars(args), "flops_per_token": fpt, "schedule_decay": "constant", "plan_peak_gib": _planned_peak(cfg)},
        "matmul_peak_tflops": peak_measured,
        "bitwise_check": check,
        "eager_step_times_s": eager,
        "eager_pipelined_step_times_s": eager_pipe,
        "graph_step_times_s": synced,
        "graph_pipelined_step_times_s": pipe,
        "eager_losses": eager_losses,
        "graph_losses": graph_losses,
        "results": rows,
    }
    save_result("graph-step", payload, save=not args.no_save)
    return 0 if check["max_rel_diff"] < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
