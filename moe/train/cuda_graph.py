"""train.cuda_graph: the whole optimizer step captured once as a CUDA graph and replayed.

Eagerly, Python launches each of a step's thousands of kernels, and wherever the host falls
behind the GPU idles (11-18 ms of a 0.5-0.6 s step in the profiles: bench/NOTES.md). A replay
launches them all at once. What makes the step capturable: it never waits for the device (no
host syncs in the hot path), its Python branches depend only on state that every step starts
from (gradients none, no rows held for a pair), and what changes from step to step reaches it as
device values written before each replay: the micro-batches (copied into static inputs), the
learning rate (``MasterWeightAdamW.keep_lr_on_device``) and the step number (the trainer's).

The first ``WARMUP`` steps run eagerly on a side stream (real steps: autotuning, workspaces and
lazily built state settle there), the next is captured and then replayed, as is every later one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger("moe.train")

WARMUP = 2


class CapturedStep:
    """``run(micro)`` performs one step of ``body`` (micro-batches in, the step's loss out, a
    device scalar of the caller's own)."""

    def __init__(self, body: Callable[[list[torch.Tensor]], torch.Tensor], device: torch.device) -> None:
        self.body, self.device = body, device
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.loss: torch.Tensor | None = None
        self.side = torch.cuda.Stream(device)
        self.capture_s: float | None = None

    def run(self, micro: list[torch.Tensor]) -> torch.Tensor:
        self.steps += 1
        if self.graph is None and self.steps <= WARMUP:
            return self._eager(micro)
        if self.graph is None:
            self._capture(micro)
        self._feed(micro)
        self.graph.replay()
        return self.loss.clone()

    def _eager(self, micro: list[torch.Tensor]) -> torch.Tensor:
        side, main = self.side, torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            loss = self.body(micro)
        main.wait_stream(side)
        return loss

    def _capture(self, micro: list[torch.Tensor]) -> None:
        if [tuple(b.shape) for b in micro] != [tuple(b.shape) for b in micro[:1]] * len(micro):
            raise ValueError("train.cuda_graph: the step's micro-batches must all have one shape")
        start = time.perf_counter()
        self.inputs = [torch.empty(b.shape, dtype=b.dtype, device=self.device) for b in micro]
        graph = torch.cuda.CUDAGraph()
        # (entering torch.cuda.graph synchronises and returns the eager steps' cached blocks, for its pool)
        # thread_local: the data loader's worker threads go on using CUDA (pinned memory)
        with torch.cuda.graph(graph, stream=self.side, capture_error_mode="thread_local"):
            self.loss = self.body(self.inputs)
        torch.cuda.synchronize(self.device)
        self.graph = graph
        self.capture_s = time.perf_counter() - start
        log.info("train.cuda_graph: captured the step in %.1f s; every later step replays it", self.capture_s)

    def _feed(self, micro: list[torch.Tensor]) -> None:
        """The step's micro-batches into the graph's inputs, ordered after the previous replay
        (which may still be reading them) on the same stream."""
        for dst, src in zip(self.inputs, micro, strict=True):
            dst.copy_(src if src.is_cuda else src.pin_memory(), non_blocking=True)
