"""The FP8 policy, one floor above the kernels: which GEMMs run in FP8 (:class:`Fp8Rule`,
:class:`Fp8Gemms`) and the FP8 copies of weights (:class:`WeightCache`), shared by the expert GEMMs
(moe.layers.gemm_fp8) and the dense projections (moe.nn.fp8_linear)."""

from __future__ import annotations

import dataclasses

import torch

from moe.config import PrecisionConfig
from moe.kernels.fp8 import E4M3, quantize_cols_grouped, quantize_rows


def _uniform_ends(groups: int, size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(1, groups + 1, device=device, dtype=torch.int32) * size


@dataclasses.dataclass(frozen=True)
class Fp8Gemms:
    """Which of a projection's three GEMMs run in FP8 (a choice per call; the memory plan is
    moe.plan's). ``sink_wgrad``: wgrad also in FP8 where the optimizer's accumulating GEMM takes
    the gradient (moe.kernels.grouped_wgrad); otherwise that GEMM takes it in bf16."""

    fwd: bool
    dgrad: bool
    wgrad: bool
    sink_wgrad: bool = False

    @property
    def any(self) -> bool:
        return self.fwd or self.dgrad or self.wgrad


# The dense projections' threshold (precision.fp8_dense_min_dim's default, written there): see Fp8Rule.
DENSE_MIN_DIM = PrecisionConfig.fp8_dense_min_dim


@dataclasses.dataclass(frozen=True)
class Fp8Rule:
    """FP8 for a GEMM whose output columns and contraction are both at least ``min_dim`` (and
    multiples of 16) and whose mean rows per expert (for a dense projection: the micro-batch's
    tokens) reach :meth:`rows_needed`; the rest stay bf16.

    Shapes come from tensor sizes (the mean rows per expert, N / G), never from the routing, so
    the choice costs no host sync. ``min_dim=0`` forces FP8 everywhere (benchmarks).

    The thresholds come from full training steps on one H200 (bench.model, learned routing, 8
    layers at OLMoE width or 2 at the paper's, 4 micro-batches, every expert GEMM in FP8 against
    bf16, pairs run back to back; bench/NOTES.md "The FP8 rule from the step sweep"). The
    quantisation passes cost a fixed amount per element moved and the FP8 GEMM saves in
    proportion to its depth, so only wide, tall GEMMs come out ahead:

    - paper width (d=4096, 64 experts of 4096, top-4): 1,024 rows per expert +2.9% to +4.3%
      (model-NVIDIA-H200-20261202T165051Z.json, T135414Z), 512 rows -1.6% (T192317Z).
    - OLMoE width (d=2048, 64 experts of 1024, top-8; GEMMs 2048x2048 and 2048x1024): 2,048 rows
      +3.8% and +3.9% (T192245Z, T192639Z), 1,024 rows +0.3% (T192551Z against T192604Z), 512
      rows -12.9% (T192146Z); the up projection alone at 2,048 rows +2.7% (T194323Z).
    - narrow (d=1024, 64 experts of 1024, top-8; GEMMs 2048x1024 and 1024x1024): every expert
      GEMM in FP8 at 2,048 rows -0.4% (T193734Z), the up projection alone -1.0% and
      -1.4% (T194042Z, T194108Z); at 4,096 rows every GEMM +2.1% (T193809Z).

    Hence, by the GEMM's smaller dimension: >= 4,096 needs 1,024 rows per expert, >= 2,048 needs
    2,048 rows, >= ``min_dim`` (1,024) needs 4,096 rows, below it bf16 (``min_rows`` overrides
    the tiers); an expert MLP's down projection follows its up projection (:meth:`plan_down`). The dense
    projections keep their own rule (``precision.fp8_dense_min_dim``, 4,096: FP8 attention at
    OLMoE width lost 2.2%, T192621Z).

    Where the optimizer's gradient sink takes an expert weight's gradient (the default,
    ``optim.expert_wgrad: gemm``), wgrad runs in FP8 (moe.kernels.grouped_wgrad.grouped_wgrad_fp8)
    only for GEMMs whose smaller dimension is at least ``sink_wgrad_min_dim`` (4,096), else in the
    bf16 accumulating GEMM. Both add into the fp32 gradient inside the GEMM, which at ~1,000 rows
    per expert is bound by that gradient's read and write: the FP8 kernel is only 1.12-1.26x the
    bf16 one, and the columnwise quantisation of its two operands costs about that much
    (bench.wgrad --fp8, wgrad-fp8-NVIDIA-H200-20261202T231453Z, T233517Z). In the step it still
    pays at paper width, where it also skips the bf16 copies of the combine's gradient rows and
    of the gathered tokens: +1.5% and +1.6% against bf16 wgrad (96.4K/96.7K against 95.0K/95.2K
    tok/s, T231757Z/T231900Z against T231819Z/T231917Z, one call), and it loses at OLMoE width:
    97.0K against 100.4K tok/s (T232029Z against T232011Z; bf16 96.5K, T232047Z).

    The defaults of the fields the config sets are written once, in moe.config.PrecisionConfig
    (``fp8_min_dim``, ``fp8_sink_wgrad_min_dim``)."""

    min_dim: int = PrecisionConfig.fp8_min_dim
    min_rows: int | None = None
    wide: int = 4096  # both dimensions at least this: 1,024 rows per expert suffice
    sink_wgrad_min_dim: int = PrecisionConfig.fp8_sink_wgrad_min_dim

    def rows_needed(self, n: int, k: int) -> int:
        """Mean rows per expert an n x k GEMM (either way round) needs to run in FP8."""
        if self.min_rows is not None:
            return self.min_rows
        if self.min_dim == 0:
            return 0
        small = min(n, k)
        return 1024 if small >= self.wide else 2048 if small >= 2048 else 4096

    def use(self, rows: float, n: int, k: int) -> bool:
        return n % 16 == 0 and k % 16 == 0 and min(n, k) >= self.min_dim and rows >= self.rows_needed(n, k)

    def plan(self, tokens: int, groups: int, out_dim: int, in_dim: int) -> Fp8Gemms:
        rows = tokens / max(groups, 1)
        # wgrad contracts over each expert's tokens (padded to 16, so no divisibility need on rows)
        wgrad = self.use(rows, out_dim, in_dim)
        return Fp8Gemms(
            fwd=self.use(rows, out_dim, in_dim),
            dgrad=self.use(rows, in_dim, out_dim),
            wgrad=wgrad,
            sink_wgrad=wgrad and (self.min_dim == 0 or min(out_dim, in_dim) >= self.sink_wgrad_min_dim),
        )

    def plan_down(self, tokens: int, groups: int, out_dim: int, in_dim: int) -> Fp8Gemms:
        """The expert MLP's down projection ([out_dim=d, in_dim=h]) follows its up projection
        ([2h, d]): the two run in FP8 together or not at all, because the step measurements
        behind the tiers are of whole MLPs (OLMoE width's down projection alone in bf16 gave
        +2.7% against +3.9% for both in FP8, T194323Z). Its own dimensions must still reach
        ``min_dim`` and be multiples of 16."""
        up = self.plan(tokens, groups, 2 * in_dim, out_dim)
        ok = out_dim % 16 == 0 and in_dim % 16 == 0 and min(out_dim, in_dim) >= self.min_dim
        sink = up.sink_wgrad and ok and (self.min_dim == 0 or min(out_dim, in_dim) >= self.sink_wgrad_min_dim)
        return Fp8Gemms(fwd=up.fwd and ok, dgrad=up.dgrad and ok, wgrad=up.wgrad and ok, sink_wgrad=sink)


class WeightCache:
    """FP8 copies of expert weights, made once per weight version.

    Weights change only at the optimizer step (which bumps the version counter of the tensor it
    writes), so the micro-batches of a step (gradient accumulation, pipeline micro-batches) share
    one rowwise copy (forward) and one transposed, columnwise copy (dgrad). Keyed by storage,
    shape and version: no host sync, never stale.

    A parameter registered with :meth:`read_from` has no bf16 values of its own (the optimizer
    dropped them, :meth:`moe.optim.MasterWeightAdamW.release_weight`): its copies are made from
    its fp32 master, rounded to bf16 first (so they are bitwise the copies of the bf16 weight the
    optimizer would have written) a few experts at a time, and the FP8 pair replaces the bf16
    weight instead of sitting beside it (2 bytes per expert parameter instead of 4). A GEMM the
    rule keeps in bf16 reads :meth:`dense`, a bf16 copy made from the master once per version."""

    # experts per quantisation chunk are chosen so the bf16 transient stays near this many elements
    CHUNK_ELEMENTS = 1 << 26

    def __init__(self) -> None:
        self._rows: dict = {}
        self._cols: dict = {}
        self._dense: dict = {}
        self._sources: dict[tuple, torch.Tensor] = {}

    def read_from(self, param: torch.Tensor, master: torch.Tensor) -> None:
        """Make ``param``'s copies from ``master`` (same shape, any float dtype)."""
        if tuple(master.shape) != tuple(param.shape):
            raise ValueError(f"master {tuple(master.shape)} and parameter {tuple(param.shape)} differ in shape")
        self._sources[self._ident(param)] = master

    @staticmethod
    def _ident(w: torch.Tensor) -> tuple:
        """Which weight ``w`` is: its storage and place in it, not the Python object, because
        under activation recompute a saved weight comes back as another tensor over the
        parameter's storage (keyed by id, the released weight's one-element stand-in was
        quantised instead of its master, and every backward added a stale copy)."""
        return (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape))

    def reads_master(self, w: torch.Tensor) -> bool:
        return self._ident(w) in self._sources

    def _source(self, w: torch.Tensor) -> torch.Tensor:
        return self._sources.get(self._ident(w), w)

    @staticmethod
    def _key(w: torch.Tensor) -> tuple:
        return (w.data_ptr(), tuple(w.shape), w._version)

    def _lookup(self, table: dict, w: torch.Tensor, make) -> tuple:
        src = self._source(w)
        key = self._key(src)
        ident = self._ident(w)
        hit = table.get(ident)
        if hit is None or hit[0] != key:
            table.pop(ident, None)  # the stale copy goes before the new one is made
            hit = (key, *make(src))
            table[ident] = hit
        return hit[1:]

    def _chunks(self, src: torch.Tensor):
        """(first expert, bf16 [g, M, K]) over src's experts, a few at a time when src is not bf16."""
        if src.dtype == torch.bfloat16:
            yield 0, src
            return
        groups, m, k = src.shape
        step = max(1, self.CHUNK_ELEMENTS // max(1, m * k))
        for g in range(0, groups, step):
            yield g, src[g : g + step].to(torch.bfloat16)

    def rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 [G, M, K], decode scales [G, M]), scales along K; for a 2-D weight [M, K] (a
        dense projection) ([M, K], [M])."""

        def make(src):
            if src.dim() == 2:
                wq, sw = make(src.unsqueeze(0))
                return wq[0], sw[0]
            groups, m, k = src.shape
            if src.dtype == torch.bfloat16:  # one pass, no staging copy
                q, s = quantize_rows(src.reshape(-1, k))
                return q.view(groups, m, k), s.view(groups, m)
            wq = torch.empty(groups, m, k, dtype=E4M3, device=src.device)
            sw = torch.empty(groups, m, dtype=torch.float32, device=src.device)
            for g, part in self._chunks(src):
                q, s = quantize_rows(part.reshape(-1, k))
                n = part.shape[0]
                wq.view(torch.uint8)[g : g + n] = q.view(torch.uint8).view(n, m, k)
                sw[g : g + n] = s.view(n, m)
            return wq, sw

        return self._lookup(self._rows, w, make)

    def cols(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 [G, K, M], decode scales [G, K]), scales along M; for a 2-D weight [M, K]
        ([K, M], [K])."""

        def make(src):
            if src.dim() == 2:
                wt, swt = make(src.unsqueeze(0))
                return wt[0], swt[0]
            groups, m, k = src.shape
            if src.dtype == torch.bfloat16:
                q, s, _ = quantize_cols_grouped(src.reshape(groups * m, k), _uniform_ends(groups, m, src.device), pad=False)
                return q, s
            wt = torch.empty(groups, k, m, dtype=E4M3, device=src.device)
            swt = torch.empty(groups, k, dtype=torch.float32, device=src.device)
            for g, part in self._chunks(src):
                n = part.shape[0]
                q, s, _ = quantize_cols_grouped(part.reshape(n * m, k), _uniform_ends(n, m, src.device), pad=False)
                wt.view(torch.uint8)[g : g + n] = q.view(torch.uint8)
                swt[g : g + n] = s
            return wt, swt

        return self._lookup(self._cols, w, make)

    def dense(self, w: torch.Tensor) -> torch.Tensor:
        """w's values in bf16, for the GEMMs the rule keeps in bf16."""
        if not self.reads_master(w):
            return w
        return self._lookup(self._dense, w, lambda src: (src.to(torch.bfloat16),))[0]
