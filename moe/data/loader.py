"""Seeded global shuffle, data-parallel sharding, micro-batching and exact resume.

Every epoch draws a fresh permutation of all sequences from (seed, epoch). A global batch is
``global_batch_size`` consecutive entries of it; data-parallel rank r takes the r-th contiguous
slice and splits it into micro-batches. The position is just (epoch, batches consumed), so a
resumed run reads exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moe.data.dataset import TokenDataset
from moe.data.tokens import TokenDataError


@dataclasses.dataclass
class LoaderState:
    epoch: int = 0
    batch_in_epoch: int = 0


class BatchLoader:
    def __init__(
        self,
        dataset: TokenDataset,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError("global_batch_size must be divisible by micro_batch_size * dp_size")
        if len(dataset) < global_batch_size:
            raise TokenDataError(
                f"{dataset.files[0]}: {len(dataset)} sequences of {dataset.seq_len + 1} tokens are fewer than one global batch of {global_batch_size}"
            )
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.state = LoaderState()
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
            self._perm = rng.permutation(len(self.dataset))
            self._perm_epoch = epoch
        return self._perm

    def global_indices(self, epoch: int, batch: int) -> np.ndarray:
        perm = self._permutation(epoch)
        return perm[batch * self.global_batch_size : (batch + 1) * self.global_batch_size]

    def next_batch(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the next global batch, each [micro, seq_len + 1]."""
        if self.state.batch_in_epoch >= self.batches_per_epoch:
            self.state = LoaderState(self.state.epoch + 1, 0)
        indices = self.global_indices(self.state.epoch, self.state.batch_in_epoch)
        self.state.batch_in_epoch += 1
        per_rank = self.global_batch_size // self.dp_size
        mine = indices[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [self.dataset.batch(mine[i : i + self.micro_batch_size]) for i in range(0, per_rank, self.micro_batch_size)]

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = LoaderState(int(state["epoch"]), int(state["batch_in_epoch"]))
