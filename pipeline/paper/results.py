"""A paper stage's result file (``<results>/<stage>.json``, as run_stage writes it): one typed
schema per stage, read through the bounded reader before the report or the tracker uses it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe.reader import Bool, FileFormatError, Int, List, Map, Nullable, Num, Plain, Spec, Str, read_json_object
from pipeline.errors import PipelineError
from pipeline.paper.claims import STAGES
from pipeline.units import LEGACY_GIB_NAMES

_RESULT_LIMIT = 64 << 20

# ------------------------------------------------------------ a stage's result file, as run_stage writes it

_FIGURE = Nullable(Num())  # a derived figure; null where a ratio had no denominator
_COUNT = Int(1, 2**31 - 1)
_NAME = Str(128, r"[A-Za-z0-9_.\-]+")  # a variant, a recompute mode, a profile category, an expert count
_TEXT = Str(4096)


def _with_legacy_gib(specs: dict[str, Spec]) -> dict[str, Spec]:
    """GiB figures under their names now and the names results before issue 49 gave them."""
    return {name: spec for figure, spec in specs.items() for name in (figure, *LEGACY_GIB_NAMES.get(figure, ()))}


@dataclass(frozen=True)
class _EmptyOr(Spec):
    """``{}`` (nothing measured: the stage had too few variants that ran) or ``inner``."""

    inner: Spec

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        return value if value == {} else self.inner.check(value, where, path)


# ExperimentConfig's model section (its own loader validates it where it is used); the expert
# count is what the report plots.
_MODEL = Map(
    optional={"moe": Map(optional={"num_experts": _COUNT}, other=Plain(8), keys=Str(64, r"[a-z_][a-z0-9_]*"), max_keys=256)},
    other=Plain(8),
    keys=Str(64, r"[a-z_][a-z0-9_]*"),
    max_keys=256,
)
# One variant (pipeline.paper.measure.measure's figures, Context.run's status and plan), or one
# not run or failed (its reason).
_VARIANT_FIELDS: dict[str, Spec] = {
    "name": _NAME,
    "status": Str(16, choices=("ok", "not run", "failed")),
    "reason": _TEXT,
    "world": _COUNT,
    "layout": Map(optional={"pp": _COUNT, "dp": _COUNT, "ep": _COUNT, "data_parallel": Str(32), "shard_optimizer": Bool()}),
    "model": _MODEL,
    **dict.fromkeys(("seq_len", "micro_batch_size", "global_batch_size", "accumulation"), _COUNT),
    "tokens_per_step_per_device": Num(0),
    "routing": Str(32),
    "dropless": Bool(),
    "tokens_dropped_fraction": Nullable(Num(0, 1)),
    "expert_grad_accum": Str(32),
    "precision": Str(32),
    "steps_timed": Int(0, 2**31 - 1),
    **dict.fromkeys(("tokens_per_s_per_device", "tflops_per_device", "step_time_s"), Num(0)),
    "mfu": Nullable(Num(0)),
    **_with_legacy_gib(dict.fromkeys(("peak_mem_gib", "mem_at_rest_gib", "peak_rss_gib", "predicted_peak_gib"), Nullable(Num(0)))),
    **_with_legacy_gib({"above_rest_gib": _FIGURE}),
    "final_loss": _FIGURE,
    "profile": Nullable(Map(other=Num(0), keys=_NAME, max_keys=64)),  # ms per category (moe.train.step_profile)
    "history": List(  # the gerrymander stage's balance-loss and load curve
        Map(optional={"step": Int(0), **dict.fromkeys(("loss", "lb_loss", "expert_load_max_over_mean"), _FIGURE)}), max_len=1_000_000
    ),
}
_MEASURED = ("tokens_per_s_per_device", "tflops_per_device", "step_time_s")  # (the order names the first one missing)
_OK_VARIANT = Map(
    required={k: _VARIANT_FIELDS[k] for k in ("name", *_MEASURED)}, optional={k: v for k, v in _VARIANT_FIELDS.items() if k not in _MEASURED}
)
_OTHER_VARIANT = Map(required={"name": _NAME}, optional={k: v for k, v in _VARIANT_FIELDS.items() if k != "name"})


@dataclass(frozen=True)
class _Variant(Spec):
    """A variant that ran (status ok) has its figures; one not run or failed need not."""

    def check(self, value: Any, where: str = "", path: str = "") -> Any:
        ran = isinstance(value, dict) and value.get("status") == "ok"
        return (_OK_VARIANT if ran else _OTHER_VARIANT).check(value, where, path)


# What each stage derives (pipeline.paper.stages), with the projections the report writes out (a
# projection's note: one computed from a result's profiles after its run).
_DERIVED: dict[str, Spec] = {
    "resident": Map(
        optional={
            **dict.fromkeys(("speedup", "tokens_per_s_per_device", "baseline_tokens_per_s_per_device", "peak_ratio"), _FIGURE),
            "projection": Map(
                required={
                    "gpus": _COUNT,
                    **dict.fromkeys(("link_gb_s", "fsdp_transfer_s", "resident_transfer_s", "speedup_no_overlap", "speedup_full_overlap"), Num(0)),
                },
                optional={"model": _TEXT, "note": _TEXT},
            ),
        }
    ),
    "experts": _EmptyOr(
        Map(
            required={"drop": Num(), "experts_from": _COUNT, "experts_to": _COUNT},
            optional={
                "tokens_per_s_per_device": Map(other=Num(0), keys=Str(16, r"[0-9]+"), max_keys=1000),
                "drop_learned": Num(),
                "projection": Map(
                    required={
                        "gpus": _COUNT,
                        "per_category_ms_per_expert": Map(other=Num(), keys=_NAME, max_keys=64),
                        "kernel_ms_one_gpu": Map(other=Num(), keys=Str(16, r"[0-9]+"), max_keys=2),
                        "kernel_ms_ep": Map(other=Num(), keys=Str(16, r"[0-9]+"), max_keys=2),
                        "drop_one_gpu_fit": Num(),
                        "drop_projected": Num(),
                    },
                    optional={"model": _TEXT, "note": _TEXT},
                ),
            },
        )
    ),
    "fp8": Map(
        optional={
            **dict.fromkeys(("speedup", "peak_ratio"), _FIGURE),
            "recipe": Nullable(Str(32)),
            **_with_legacy_gib(dict.fromkeys(("peak_gib", "baseline_peak_gib"), _FIGURE)),
            "projection": Map(
                required={
                    "gpus": _COUNT,
                    "expert_gemm_speedup": _FIGURE,
                    **dict.fromkeys(("expert_gemm_share_bf16", "quantize_ms", "speedup_bound_at_gpus", "speedup_ceiling_expert_gemms_free"), Num()),
                },
                optional={"note": _TEXT},
            ),
        }
    ),
    "recompute": Map(
        other=Map(optional=dict.fromkeys(("above_rest_ratio", "activation_ratio", "peak_ratio", "throughput_ratio"), _FIGURE)),
        keys=_NAME,
        max_keys=64,
    ),
    "ep": Map(other=Map(required={"step_time_s": Num(0)}, optional={"relative_to_ep1": _FIGURE}), keys=_NAME, max_keys=256),
    "gerrymander": Map(
        optional={
            **dict.fromkeys(
                (
                    "lb_loss_first",
                    "lb_loss_last",
                    "max_over_mean_first",
                    "max_over_mean_last",
                    "lb_loss_trend_per_1k",
                    "max_over_mean_trend_per_1k",
                ),
                _FIGURE,
            ),
            "diverging": Bool(),
            "alarm": _TEXT,
            "alarm_lines": List(_TEXT, max_len=100_000),
        }
    ),
}


def _stage_result_schema(stage: str) -> Map:
    return Map(
        required={
            "hardware": Map(
                required={"describe": Str(256)},
                optional={
                    "kind": Str(8, choices=("cpu", "gpu")),
                    "name": Str(256),
                    "count": _COUNT,
                    **_with_legacy_gib({"memory_gib": Nullable(Num(0))}),
                    "capability": Nullable(List(Int(0, 1000), min_len=2, max_len=2)),
                },
            ),
            "scaling": Map(
                required={"shape": Str(16384)},
                optional={"notes": List(_TEXT, max_len=1000), "model": _MODEL, "seq_len": _COUNT, "micro_batch_size": _COUNT},
            ),
            "variants": List(_Variant(), max_len=10_000),
        },
        optional={
            "stage": Str(32, choices=(stage,)),  # the file's own stage: <results>/<stage>.json
            "claim": Map(
                optional={
                    "stage": Str(32),
                    **dict.fromkeys(("title", "paper", "paper_hardware"), _TEXT),
                    "reference": Map(other=Num(), keys=_NAME, max_keys=64),
                    "gpus": _COUNT,
                }
            ),
            "steps_per_measurement": Int(0, 2**31 - 1),
            "commit": Str(64),  # commit_label()
            "note": _TEXT,
            "derived": _DERIVED[stage],
        },
    )


STAGE_RESULT_SCHEMAS = {stage: _stage_result_schema(stage) for stage in STAGES}


def load_stage_result(path: Path) -> dict[str, Any]:
    """A stage's result file (``<results>/<stage>.json``), checked against what run_stage writes
    for that stage (STAGE_RESULT_SCHEMAS): one error naming the file and the field, before
    anything is written."""

    def bad(what: str) -> PipelineError:
        return PipelineError(f"{path}: {what} (not a `moe paper stage` result file)")

    if path.stem not in STAGE_RESULT_SCHEMAS:
        raise bad(f"the file is not named after a stage ({', '.join(STAGES)})")
    try:
        r = read_json_object(path, _RESULT_LIMIT)
    except FileFormatError as exc:  # not a regular file, too large, not UTF-8, not JSON, not an object
        raise bad(str(exc).removeprefix(f"{path}: ")) from None
    try:
        return STAGE_RESULT_SCHEMAS[path.stem].check(r)
    except FileFormatError as exc:
        problem = str(exc)
        raise bad(problem.removesuffix(": missing") + " is missing" if problem.endswith(": missing") else problem) from None
