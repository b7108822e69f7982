"""`moe plan`'s verdict: measured H200 peaks predicted, the knob that helps most, bad input
refused clearly, and held-out runs' peaks covered."""

import dataclasses
import json
from pathlib import Path

import pytest

from moe.config import ConfigError, ExperimentConfig
from moe.errors import PlanError
from moe.plan.planner import WORKSPACE_GIB, make_plan
from moe.plan.report import format_plan


def olmoe(layers, micro=4, accum=1, recompute="none", parallel=None, dp=1):
    return ExperimentConfig.load(
        {
            "model": {"preset": "olmoe-1b-7b", "n_layers": layers, "max_seq_len": 4096},
            "data": {"seq_len": 4096},
            # measured with torch's loss (before train.fused_loss)
            "train": {"global_batch_size": micro * accum * dp, "micro_batch_size": micro, "recompute": recompute, "fused_loss": False},
            "parallel": parallel or {},
            "precision": {"recipe": "bf16"},
            "schedule": {"warmup_steps": 1},
        }
    )


def test_measured_h200_peaks_are_predicted_within_ten_percent():
    """Peaks measured by bench/memory.py on an H200 (bench/results/memory-NVIDIA-H200-*.json)."""
    for layers, micro, accum, mode, measured in [
        (8, 4, 1, "none", 79.11),
        (12, 4, 2, "none", 132.09),
        (12, 4, 2, "selective", 110.99),
        (16, 4, 1, "full", 117.93),
    ]:
        plan = make_plan(olmoe(layers, micro, accum, mode), "h200", 1, knobs=False)
        allocated = plan.peak_gib - plan.memory_gib["CUDA workspace allowance"]
        assert allocated == pytest.approx(measured, rel=0.1), (layers, micro, accum, mode)


def test_verdict_and_the_knob_that_helps_most():
    plan = make_plan(olmoe(18), "h200", 1)  # 18: 16 layers are predicted to fit (just) since the fused RMSNorm keeps less
    assert not plan.fits and plan.knobs
    assert plan.knobs[0]["set"] == "train.recompute=selective" and plan.knobs[0]["fits"]
    text = format_plan(plan)
    assert "does not fit" in text and "train.recompute=selective" in text
    assert make_plan(olmoe(18), "b300", 1).fits
    two = make_plan(olmoe(18, parallel={"ep": 2}, dp=2), "h200", 2)
    assert two.params_total == plan.params_total and two.memory_gib["weights"] < plan.memory_gib["weights"]
    assert json.loads(json.dumps(two.to_dict()))["fits"] == two.fits


def test_a_config_too_big_for_one_gpu_is_told_the_gpu_count_that_fits():
    """The smallest GPU count of one host on which a data-parallel flavour fits (the batch sizes
    kept), best first, and the flavour it names does fit there."""
    cfg = olmoe(18, accum=2)
    plan = make_plan(cfg, "h200", 1)
    best = plan.scale_out[0]
    assert not plan.fits and best["gpus"] == 2 and best["set"] == ["parallel.ep=2", "parallel.shard_optimizer=true"]
    assert make_plan(ExperimentConfig.load(cfg.to_dict(), best["set"]), "h200", 2, knobs=False).fits
    assert f"on 2 GPUs it fits with parallel.ep=2 parallel.shard_optimizer=true (peak {best['peak_gib']:.1f} GiB)" in plan.verdict()
    assert "also on 2 GPUs it fits with" in format_plan(plan)
    assert make_plan(olmoe(4), "h200", 1).scale_out is None  # it fits: nothing searched
    # one micro-batch of 4 is the whole global batch: no count above 1 divides it
    assert make_plan(olmoe(18), "h200", 1).scale_out == []


def test_bad_input_fails_clearly():
    with pytest.raises(PlanError, match="--gpu: unknown GPU 'a100'; known: h100, h200, b200, b300"):
        make_plan(olmoe(2), "a100", 1)
    with pytest.raises(PlanError, match="--gpus: must be >= 1"):
        make_plan(olmoe(2), "h100", 0)
    with pytest.raises(PlanError, match="--mfu"):
        make_plan(olmoe(2), "h100", 1, mfu=1.5)
    with pytest.raises(ConfigError, match="parallel.pp: world size 3 is not divisible by pp=2"):
        make_plan(olmoe(2, parallel={"pp": 2}), "h100", 3)


RESULTS = Path(__file__).resolve().parents[2] / "bench/results"


def _result(path: Path) -> dict:
    return json.loads(path.read_text())["result"]


# Measured on one H200 on 2026-12-02 (bench/h200/plan_and_fp8_memory.sh plan): 1-4 micro-batches,
# recompute none/selective/full, the olmoe-1b-7b recipe's logit z-loss on and off.
HELD_OUT = sorted(
    p
    for p in RESULTS.glob("model-NVIDIA-H200-20261202T01*.json")
    if _result(p).get("plan_peak_gib") is not None and _result(p).get("recipe") == "bf16"
)
# fp8_rowwise records that name fp8_sink_wgrad_min_dim: bench.model gained that flag with
# Fp8Gemms.sink_wgrad (f192d42, 2026-12-02 23:16), after the rule's row tiers and its down
# projection following the up one were settled, so these ran today's Fp8Rule (paper and OLMoE
# width, FP8 dense projections and the sink-wgrad A/B included). Older FP8 records ran rules
# their config cannot express (the rows per expert a GEMM needed changed three times that
# evening; before 1ba753f the bf16 expert weights were kept, and T015446Z's breakdown shows an
# FP8 layer that still saved its quantised operands); the rule decides the plan, so they are left out.
FP8_HELD_OUT = sorted(
    p
    for p in RESULTS.glob("model-NVIDIA-H200-*.json")
    if _result(p).get("recipe") == "fp8_rowwise" and "fp8_sink_wgrad_min_dim" in json.loads(p.read_text())["config"]
)


# optim.expert_wgrad=paired at OLMoE width, 8 layers, micro 4 x accum 4 (bench/h200/wgrad_paired.sh,
# 2026-12-04): the rows one micro-batch leaves in the sinks, on top of the gemm peak beside them.
PAIRED_HELD_OUT = sorted(p for p in (RESULTS / "wgrad_paired").glob("model-NVIDIA-H200-*.json") if _result(p).get("expert_wgrad") == "paired")


# Today's bf16 step against fp8_rowwise (bench/h200/fp8.sh final2, 2026-12-07): eager and graphed,
# optim.expert_wgrad gemm and paired, both recipes, OLMoE, narrow and paper width (an H100 where an
# H200 did not start; the plan does not depend on the card's size).
FINAL2_HELD_OUT = sorted((RESULTS / "fp8_final2").glob("*/model-*.json"))


FP8_EXPERT_LINES = ("FP8: bf16 expert weights released", "FP8: bf16 expert rows not saved", "FP8 expert backward")


@pytest.mark.parametrize("path", HELD_OUT + FP8_HELD_OUT + PAIRED_HELD_OUT + FINAL2_HELD_OUT, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_plan_covers_the_measured_peak_within_five_percent(path, tmp_path):
    """A plan that says "fits" must fit: the predicted peak is at or above the peak measured on
    the GPU (torch.cuda.max_memory_allocated), and not more than 5% above it; its modelled bytes
    (all but the fixed workspace allowance) within 5% either way."""
    import argparse

    from bench.model import build_config

    record = json.loads(path.read_text())
    config = record["config"]
    args = argparse.Namespace(**{k: v for k, v in config.items() if k != "flops_per_token"})
    cfg = build_config(args, tmp_path / "tokens", tmp_path / "ck", 10)
    plan = make_plan(cfg, "h200", 1, knobs=False)
    planned = plan.peak_gib
    result = record["result"]
    if result["recipe"] == "fp8_rowwise" and all(plan.memory_gib[k] == 0 for k in FP8_EXPERT_LINES):
        # the rule keeps every expert GEMM bf16 at this shape: since 2026-12-07 such a run is the
        # bf16 recipe's (PrecisionRecipe.keep_bf16_where_fp8_does_not_run), not the one recorded
        bf16 = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, recipe="bf16"))
        assert planned == make_plan(bf16, "h200", 1, knobs=False).peak_gib
        return
    measured = result.get("peak_mem_gib", result.get("peak_mem_gb"))  # peak_mem_gb: GiB despite its name
    if result["recipe"] == "bf16":  # what the run itself printed (FP8 plans changed since: issue 49),
        # or less by the bf16 expert gradient the sink never makes (planned until 2026-12-07)
        assert planned == pytest.approx(result["plan_peak_gib"], rel=1e-6) or planned < result["plan_peak_gib"]
    assert measured <= planned, (planned, measured)
    # the modelled bytes, without the fixed allowance for what the allocator does not count
    assert abs(planned - WORKSPACE_GIB - measured) <= 0.05 * measured, (planned, measured)
    if measured >= 40:  # below, the 2 GiB allowance alone is 5% (d = h = 1024: 33.65 GiB measured)
        assert planned <= 1.05 * measured, (planned, measured)


def test_there_are_held_out_measurements():
    assert len(HELD_OUT) >= 6 and len(FP8_HELD_OUT) >= 5 and len(PAIRED_HELD_OUT) >= 2 and len(FINAL2_HELD_OUT) >= 20


def test_a_paired_weight_gradient_plans_the_rows_it_holds():
    """optim.expert_wgrad=paired: one micro-batch's expert rows (both weights' operands, bf16,
    every MoE layer) on top of gemm's peak; nothing with a single micro-batch."""

    def peak(wgrad: str, accum: int) -> tuple[float, dict]:
        cfg = ExperimentConfig.load(
            {
                "recipe": "olmoe-1b-7b",
                "model": {"n_layers": 4},
                "optim": {"expert_wgrad": wgrad},
                "train": {"micro_batch_size": 2, "global_batch_size": 2 * accum, "device": "cuda", "max_steps": 5000},
            }
        )
        plan = make_plan(cfg, "h200", 1, knobs=False)
        return plan.peak_gib, plan.to_dict()

    gemm_peak, _ = peak("gemm", 4)
    paired_peak, plan = peak("paired", 4)
    m = ExperimentConfig.load({"recipe": "olmoe-1b-7b", "train": {"max_steps": 5000}}).model
    rows = 2 * m.max_seq_len * m.moe.top_k
    held = rows * 2 * (3 * m.moe.expert_hidden + 2 * m.d_model) * 4 / 2**30
    assert paired_peak == pytest.approx(gemm_peak + held, rel=1e-6)
    assert "expert rows held for the paired weight gradient" in json.dumps(plan)
    assert peak("paired", 1)[0] == pytest.approx(peak("gemm", 1)[0], rel=1e-9)
    # a config that does not fit is told what gemm would save
    full = ExperimentConfig.load(
        {
            "recipe": "olmoe-1b-7b",
            "optim": {"expert_wgrad": "paired"},
            "train": {"micro_batch_size": 2, "global_batch_size": 8, "device": "cuda", "max_steps": 5000},
        }
    )
    too_big = make_plan(full, "h200", 1)
    assert not too_big.fits
    knobs = {k["set"]: k["saves_gib"] for k in too_big.knobs}
    assert knobs["optim.expert_wgrad=gemm"] == pytest.approx(held * full.model.n_layers / 4, rel=1e-6)


def test_the_sink_s_expert_weights_have_no_bf16_gradient_to_plan():
    """Where the gradient sink adds an expert weight's gradient into its fp32 gradient inside the
    GEMM (optim.expert_wgrad gemm or paired), the largest low-precision gradient the end of
    backward holds is a dense weight's; with ``separate`` it is the experts' gate_up."""
    from moe.plan.ranks import rank_states

    def transient(wgrad: str) -> int:
        cfg = ExperimentConfig.load(
            {"recipe": "olmoe-1b-7b", "model": {"n_layers": 2}, "optim": {"expert_wgrad": wgrad}, "train": {"max_steps": 5000}}
        )
        (state,) = rank_states(cfg, cfg.resolve(1))
        return state.transient_grad

    m = ExperimentConfig.load({"recipe": "olmoe-1b-7b", "train": {"max_steps": 5000}}).model
    assert transient("separate") == 2 * m.moe.num_experts * 2 * m.moe.expert_hidden * m.d_model
    assert transient("gemm") == transient("paired") == 2 * m.vocab_size * m.d_model  # the embedding or the head


def test_an_fp8_weight_gradient_the_sink_takes_in_bf16_holds_bf16_rows_when_paired():
    """fp8_rowwise at OLMoE width: the rule runs wgrad in FP8 but the sink takes it in bf16
    (smaller dimension below precision.fp8_sink_wgrad_min_dim), so a paired sink holds the same
    bf16 rows as bf16's (H100, 6 layers: +10.50 GiB measured from gemm to paired, both recipes)."""

    def held(recipe: str, sink_min: int | None = None) -> float:
        precision = {"recipe": recipe, **({"fp8_sink_wgrad_min_dim": sink_min} if sink_min is not None else {})}
        cfg = ExperimentConfig.load(
            {
                "recipe": "olmoe-1b-7b",
                "model": {"n_layers": 4},
                "optim": {"expert_wgrad": "paired"},
                "precision": precision,
                "train": {"micro_batch_size": 4, "global_batch_size": 16, "device": "cuda", "max_steps": 5000},
            }
        )
        return make_plan(cfg, "h200", 1, knobs=False).memory_gib["expert rows held for the paired weight gradient"]

    assert held("fp8_rowwise") == pytest.approx(held("bf16"), rel=1e-9) and held("bf16") > 0
    assert held("fp8_rowwise", sink_min=0) == 0  # every FP8 wgrad through the FP8 sink: nothing held


def test_a_graphed_step_s_pool_is_named_as_not_counted():
    """train.cuda_graph: the graph's private pool holds memory beyond the allocator's peak that the
    plan does not model; the table and the JSON say so, and an eager plan says nothing."""

    def plan(graph: bool):
        cfg = ExperimentConfig.load(
            {"recipe": "olmoe-1b-7b", "model": {"n_layers": 2}, "train": {"cuda_graph": graph, "device": "cuda", "max_steps": 5000}}
        )
        return make_plan(cfg, "h100", 1, knobs=False)

    graphed = plan(True)
    assert graphed.peak_gib == plan(False).peak_gib and not plan(False).notes
    assert any("train.cuda_graph" in n and "GiB" in n for n in graphed.notes)
    assert graphed.notes[0] in format_plan(graphed) and graphed.to_dict()["notes"] == graphed.notes
