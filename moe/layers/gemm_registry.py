"""The expert GEMM a config names (``model.moe.gemm``)."""

from __future__ import annotations

from moe.layers.gemm import ExpertGemm, GroupedMM

EXPERT_GEMMS: dict[str, type] = {"grouped_mm": GroupedMM}


def build_expert_gemm(name: str) -> ExpertGemm:
    try:
        return EXPERT_GEMMS[name]()
    except KeyError:
        raise ValueError(f"model.moe.gemm: unknown expert GEMM {name!r}; known: {sorted(EXPERT_GEMMS)}") from None
