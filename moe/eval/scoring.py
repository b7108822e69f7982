"""Summed continuation log-likelihoods of many requests, batched for speed.

Requests are grouped so that one forward pass serves every single-token continuation of the
same context (multiple-choice letters " A".." D" share their prompt: one sequence, not four),
sorted by length and packed into batches of at most ``batch_tokens`` padded tokens, so a
batch wastes little on padding. Log-probabilities are taken in fp32 whatever the model's
dtype. ``shard``/``num_shards`` split the work across data-parallel ranks; every rank makes
the same number of forward calls (collective layouts need that), the spare ones on padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from moe.errors import ConfigError
from moe.eval.requests import Request

Forward = Callable[[torch.Tensor], torch.Tensor]  # token ids [B, T] -> logits [B, T, V]


@dataclasses.dataclass
class _Sequence:
    ids: tuple[int, ...]
    # (request index, position of its first continuation prediction, continuation ids)
    reads: list[tuple[int, int, tuple[int, ...]]]


def _sequences(requests: Sequence[Request], max_len: int) -> list[_Sequence]:
    out: list[_Sequence] = []
    shared: dict[tuple[int, ...], _Sequence] = {}
    for i, r in enumerate(requests):
        if len(r.cont) > max_len:
            raise ConfigError(
                f"request {r.doc_id}/{r.cont_id}: its continuation ({len(r.cont)} tokens) is longer than the model's context ({max_len})"
            )
        ids, start = r.query(max_len)
        if len(r.cont) == 1:  # a one-token continuation reads the logits after its context
            seq = shared.get(ids)
            if seq is None:
                seq = shared[ids] = _Sequence(ids, [])
                out.append(seq)
            seq.reads.append((i, start, r.cont))
        else:
            out.append(_Sequence(ids, [(i, start, r.cont)]))
    return out


def _batches(seqs: list[_Sequence], batch_tokens: int) -> list[list[_Sequence]]:
    """Longest first, each batch at most ``batch_tokens`` padded tokens (at least one sequence)."""
    order = sorted(seqs, key=lambda s: -len(s.ids))
    out: list[list[_Sequence]] = []
    for s in order:
        if out and (len(out[-1]) + 1) * len(out[-1][0].ids) <= batch_tokens:
            out[-1].append(s)
        else:
            out.append([s])
    return out


@torch.no_grad()
def score_requests(
    forward: Forward,
    requests: Sequence[Request],
    *,
    max_len: int,
    device: torch.device,
    batch_tokens: int = 16384,
    pad_id: int = 0,
    shard: int = 0,
    num_shards: int = 1,
    equal_calls: Callable[[int], int] | None = None,
) -> dict[int, float]:
    """request index -> summed log-probability of its continuation (natural log), for this
    shard's share (every ``num_shards``-th batch). ``equal_calls(n)`` returns the largest batch
    count of any shard (a collective): this shard pads its forward calls up to it."""
    batches = _batches(_sequences(requests, max_len), batch_tokens)
    mine = batches[shard::num_shards]
    calls = equal_calls(len(mine)) if equal_calls is not None else len(mine)
    indices: list[int] = []
    sums: list[torch.Tensor] = []
    for b in range(calls):
        batch = mine[b] if b < len(mine) else (mine[-1] if mine else [_Sequence((pad_id,), [])])
        width = max(len(s.ids) for s in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, : len(s.ids)] = torch.tensor(s.ids, dtype=torch.long)
        logits = forward(ids.to(device, non_blocking=True))
        if b >= len(mine):
            continue  # a padding call: the collectives ran, the result is not needed
        sums.append(_continuation_sums(logits, batch, indices))
    if not sums:
        return {}
    values = torch.cat(sums).tolist()  # one transfer to the host for the whole shard
    return dict(zip(indices, values, strict=True))


def _continuation_sums(logits: torch.Tensor, batch: list[_Sequence], indices: list[int]) -> torch.Tensor:
    """The summed log-probability of every read of the batch (appending its request index to
    ``indices``), from the logits of the predicting positions only (fp32 log-softmax)."""
    rows: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    ends: list[int] = []  # where each read's tokens end in the flat list (reads are contiguous)
    for row, s in enumerate(batch):
        for index, start, cont in s.reads:
            indices.append(index)
            rows += [row] * len(cont)
            positions += range(start, start + len(cont))
            targets += cont
            ends.append(len(targets))
    device = logits.device
    picked = logits[torch.tensor(rows, device=device), torch.tensor(positions, device=device)].float()
    logp = F.log_softmax(picked, dim=-1).gather(-1, torch.tensor(targets, device=device).unsqueeze(-1)).squeeze(-1)
    # segment sums by differences of a float64 prefix sum: fixed order (deterministic), no atomics
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64, device=device), logp.double().cumsum(0)])
    end = torch.tensor(ends, device=device)
    begin = torch.cat([torch.zeros(1, dtype=torch.long, device=device), end[:-1]])
    return (prefix[end] - prefix[begin]).float()
