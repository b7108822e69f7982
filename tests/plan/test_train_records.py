"""`moe plan` against `moe train`: the runs of bench/h200/train_memory.sh (one H200, bf16 and
fp8_rowwise at OLMoE width and at the paper's) re-planned from the config each run resolved and
recorded (job.json), against the peak it measured (the last metrics row): within 5% above it,
and never more than 2% under it (a plan that says "fits" must fit)."""

import json
from pathlib import Path

import pytest

from moe.config import ExperimentConfig, ResolvedLayout
from moe.plan.planner import make_plan

RESULTS = Path(__file__).resolve().parents[2] / "bench/results/train_memory"
# and the Qwen-like runs of bench/h200/wgrad_paired.sh and qwen_log_every.sh (optim.expert_wgrad gemm and paired)
PAIRED = RESULTS.parent / "wgrad_paired"
RUNS = sorted(str(p).removesuffix(".job.json") for d in (RESULTS, PAIRED) for p in d.glob("*.job.json"))


def measured_peak_gib(metrics: Path) -> float:
    """The run's peak (torch.cuda.max_memory_allocated / 2**30, never reset): the last row's
    peak_mem_gib, or peak_mem_gb in records written before the rename (GiB despite the name)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    last = rows[-1]
    return last["peak_mem_gib"] if "peak_mem_gib" in last else last["peak_mem_gb"]


def replanned_peak_gib(job: Path) -> float:
    record = json.loads(job.read_text())
    record["config"]["train"].setdefault("fused_loss", False)  # ran before train.fused_loss: torch's loss
    cfg = ExperimentConfig.load(record["config"])
    world = ResolvedLayout.from_dict(record["layout"]).world_size
    return make_plan(cfg, "h200", world, knobs=False).peak_gib


@pytest.mark.parametrize("run", RUNS, ids=lambda r: Path(r).name)
def test_the_plan_is_within_five_percent_of_the_trained_peak(run):
    planned = replanned_peak_gib(Path(f"{run}.job.json"))
    measured = measured_peak_gib(Path(f"{run}.jsonl"))
    name = Path(run).name
    assert 0.98 * measured <= planned <= 1.05 * measured, (name, planned, measured)


def test_the_records_cover_both_recipes_at_both_widths_and_both_expert_wgrads():
    names = [Path(r).name for r in RUNS]
    assert names[:4] == ["olmoe-bf16", "olmoe-fp8_rowwise", "paper-bf16", "paper-fp8_rowwise"]
    wgrads = {json.loads(Path(f"{r}.job.json").read_text())["config"]["optim"]["expert_wgrad"] for r in RUNS[4:]}
    assert wgrads == {"gemm", "paired"}


def test_the_legacy_metric_name_is_read(tmp_path):
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old.write_text('{"step": 1, "peak_mem_gb": 1.0}\n{"step": 2, "peak_mem_gb": 2.5}\n')
    new.write_text('{"step": 1, "peak_mem_gib": 3.0}\n\n')
    assert measured_peak_gib(old) == 2.5 and measured_peak_gib(new) == 3.0
