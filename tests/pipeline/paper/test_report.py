"""`moe paper report` writes only what it owns, inside the project, from result files it has
checked (issue 37): the committed H200 results are the input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.paper.report import PLOT_NAMES, write_report

REPO = Path(__file__).resolve().parents[3]
H200 = REPO / "bench/paper/h200x1/results"


@pytest.fixture
def project(tmp_path, monkeypatch):
    shutil.copytree(H200, tmp_path / "h200/results")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_report_and_its_plots_are_written_and_rewritten(project):
    report = write_report("h200/results", "h200")
    assert report == Path("h200/REPORT.md") and report.read_text().startswith("# Reproducing the paper's system claims")
    assert sorted(p.name for p in Path("h200/plots").glob("*.png")) == sorted(PLOT_NAMES)
    write_report("h200/results", "h200")  # its own outputs are replaced


def test_memory_is_reported_in_gib_from_results_before_and_after_the_gib_names(project):
    """Issue 49: memory figures are GiB and named *_gib; the committed results name them *_gb
    (and a GPU's memory_gb, described as "GB"): both read the same, and the report says GiB."""
    from pipeline.units import GIB_NAME

    before = write_report("h200/results", "h200").read_text()
    assert "on: 1x NVIDIA H200, 140 GiB." in before and "peak 85.2 -> 85.1 GiB" in before
    assert "| peak GiB (plan) | peak above rest GiB |" in before and "| 85.1 (85.4) | 25.3 |" in before

    def renamed(x):
        if isinstance(x, dict):
            return {GIB_NAME.get(k, k): renamed(v) for k, v in x.items()}
        return [renamed(v) for v in x] if isinstance(x, list) else x

    older = 0
    for path in Path("h200/results").glob("*.json"):
        text = path.read_text()
        if '_gib"' in text:  # a stage measured after the rename
            continue
        older += 1
        path.write_text(json.dumps(renamed(json.loads(text))))
        assert '_gb"' not in path.read_text()
    assert older >= 3  # most committed results are the older kind
    assert write_report("h200/results", "h200").read_text() == before


def test_a_users_report_and_a_planted_plot_link_are_refused(project):
    (project / "h200/REPORT.md").write_text("# my notes\n")
    with pytest.raises(PipelineError, match="REPORT.md exists and was not written by this stage"):
        write_report("h200/results", "h200")
    assert (project / "h200/REPORT.md").read_text() == "# my notes\n" and not (project / "h200/plots").exists()

    (project / "h200/REPORT.md").unlink()
    (project / "h200/plots").mkdir()
    (project / "precious.png").write_bytes(b"precious")
    (project / "h200/plots/experts.png").symlink_to(project / "precious.png")
    with pytest.raises(PipelineError, match="symlink"):
        write_report("h200/results", "h200")
    assert (project / "precious.png").read_bytes() == b"precious" and not (project / "h200/REPORT.md").exists()


def test_results_outside_the_project_are_refused(project, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere")
    shutil.copytree(H200, outside / "results")
    with pytest.raises(PipelineError, match="outside this project"):
        write_report(outside / "results", outside)
    assert not (outside / "REPORT.md").exists() and not (outside / "plots").exists()


@pytest.mark.parametrize(
    "content,field",
    [
        ("[1, 2]", "the top level is a list"),
        ('{"hardware": {"describe": "x"}, "variants": []}', "scaling is missing"),
        (
            '{"hardware": {"describe": "x"}, "scaling": {"shape": "s"}, "variants": [{"name": "a", "status": "ok"}]}',
            r"variants\[0\].tokens_per_s_per_device",
        ),
        ("{broken", "the file is not JSON"),
    ],
    ids=["list", "no-scaling", "variant-without-numbers", "broken-json"],
)
def test_a_result_file_that_is_not_one_is_one_error_naming_it(project, content, field):
    (project / "h200/results/fp8.json").write_text(content)
    with pytest.raises(PipelineError, match=rf"fp8.json: {field}"):
        write_report("h200/results", "h200")
    assert not (project / "h200/REPORT.md").exists()


def test_the_cli_refuses_a_results_folder_at_the_root(project):
    from typer.testing import CliRunner

    from pipeline.cli import app

    params = json.loads(json.dumps({"paper": {"results": "/etc"}}))
    (project / "params.yaml").write_text(json.dumps(params))
    result = CliRunner().invoke(app, ["paper", "report", "--no-mlflow"])
    assert result.exit_code != 0 and "outside this project" in result.output, result.output
    assert not Path("/REPORT.md").exists()


def test_a_measurement_folder_is_replaced_only_when_everything_in_it_is_a_runs_own(tmp_path):
    """The paper marker alone is not proof (issue 37): a user's file beside it stops the removal."""
    from pipeline.paper.measure import MARKER, fresh_run_dir
    from pipeline.run_dirs import LOG_HEADER

    run = fresh_run_dir(tmp_path / "fp8-bf16")
    assert (run / MARKER).is_file() and len(list(run.iterdir())) == 1
    (run / "logs").mkdir()
    (run / "logs/rank0.log").write_text(f"{LOG_HEADER}: rank 0 of 1\nstep 1\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 6.2}\n')
    (run / "notes.txt").write_text("my notes\n")
    with pytest.raises(PipelineError, match="holds notes.txt"):
        fresh_run_dir(run)
    assert (run / "notes.txt").read_text() == "my notes\n"
    (run / "notes.txt").unlink()
    assert list(fresh_run_dir(run).iterdir()) == [run / MARKER]


# ------------------------------------------------- issue 50: a result file is read through moe.reader


def test_a_fifo_in_place_of_a_result_file_is_one_error_at_once(project):
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(project / "h200/results/fp8.json")
    with pytest.raises(PipelineError, match=r"fp8.json: not a regular file \(not a `moe paper stage` result file\)"):
        within(lambda: write_report("h200/results", "h200"), fifo)
    assert not (project / "h200/REPORT.md").exists()


def _edited(change) -> str:
    result = json.loads((H200 / "fp8.json").read_text())
    change(result)
    return json.dumps(result)


def _set(path: str, value):
    """``change`` for _edited: the field at ``path`` (dotted, [i] for list items) set to ``value``."""
    import re

    def change(r):
        keys = [int(k) if k.isdigit() else k for k in re.findall(r"[^.\[\]]+", path)]
        for k in keys[:-1]:
            r = r[k]
        r[keys[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_set("variants[0].step_time_s", "fast"), r"variants\[0\].step_time_s: expected a finite number, got 'fast'"),
        (_set("variants[1].tokens_dropped_fraction", 1.5), r"variants\[1\].tokens_dropped_fraction: expected a finite number in \[0, 1\], got 1.5"),
        (_set("derived.projection.extra", 1), r"derived.projection.extra: unknown key"),
        (_set("hardware.count", 0), r"hardware.count: expected an integer in \[1, "),
        (_set("stage", "ep"), r"stage: expected one of fp8, got 'ep'"),  # another stage's result under fp8.json
        (_set("derived.speedup", float("nan")), r"the file is not JSON \(NaN is not a number JSON allows\)"),
        (lambda r: r["variants"][0].pop("tflops_per_device"), r"variants\[0\].tflops_per_device is missing"),
    ],
    ids=["text-for-a-number", "fraction-over-1", "unknown-key", "no-gpus", "another-stage", "nan", "missing-figure"],
)
def test_a_result_file_is_checked_against_what_the_stage_writes(project, change, said):
    (project / "h200/results/fp8.json").write_text(_edited(change))
    with pytest.raises(PipelineError, match=rf"^h200/results/fp8.json: {said}.*\(not a `moe paper stage` result file\)$"):
        write_report("h200/results", "h200")
    assert not (project / "h200/REPORT.md").exists()


def test_a_cpu_run_with_variants_not_run_is_a_result(tmp_path):
    """What run_stage writes on CPUs (nulls for GPU figures, an FP8 variant not run) reads back."""
    from pipeline.paper.results import load_stage_result
    from pipeline.paper.stages import _is_stage_result

    ran = {
        "name": "fp8-baseline-auto",
        "status": "ok",
        "world": 2,
        "layout": {"pp": 1, "dp": 2, "ep": 2, "data_parallel": "ddp", "shard_optimizer": True},
        "model": {"preset": "tiny", "d_model": 64, "moe": {"num_experts": 8, "top_k": 2}},
        "tokens_per_s_per_device": 1200.5,
        "tflops_per_device": 0.01,
        "step_time_s": 0.2,
        "mfu": None,
        "peak_mem_gib": None,
        "mem_at_rest_gib": None,
        "above_rest_gib": None,
        "peak_rss_gib": 1.2,
        "tokens_dropped_fraction": None,
        "profile": None,
        "predicted_peak_gib": None,
        "final_loss": 6.1,
    }
    result = {
        "stage": "fp8",
        "claim": {"stage": "fp8", "title": "t", "paper": "p", "paper_hardware": "h", "reference": {"speedup": 1.21}, "gpus": 4},
        "hardware": {"kind": "cpu", "name": "cpu", "count": 2, "memory_gib": None, "capability": None, "describe": "2 CPU processes (gloo)"},
        "scaling": {"shape": "tiny", "notes": [], "model": ran["model"], "seq_len": 64, "micro_batch_size": 4},
        "steps_per_measurement": 2,
        "commit": "0123456789ab-dirty",
        "variants": [ran, {"name": "fp8", "status": "not run", "reason": "FP8 needs a CUDA GPU"}],
        "derived": {},
    }
    (tmp_path / "fp8.json").write_text(json.dumps(result))
    assert load_stage_result(tmp_path / "fp8.json") == result and _is_stage_result(tmp_path / "fp8.json")
    (tmp_path / "notes.json").write_text(json.dumps(result))
    with pytest.raises(PipelineError, match="notes.json: the file is not named after a stage"):
        load_stage_result(tmp_path / "notes.json")


def test_the_parent_run_gets_every_stages_derived_figures(project):
    from types import SimpleNamespace

    from pipeline.paper.cli import _log_parent_metrics

    sent = []
    client = SimpleNamespace(log_batch=lambda run_id, metrics: sent.extend(m.key for m in metrics))
    _log_parent_metrics(SimpleNamespace(client=client, parent_id="p"), Path("h200/results"))
    assert {"fp8/speedup", "fp8/peak_gib", "recompute/full/peak_ratio", "ep/ep1-nccl/step_time_s"} <= set(sent)


def test_the_gerrymander_stage_refuses_a_fifo_for_its_manifest(tmp_path):
    from types import SimpleNamespace

    from pipeline.paper.stages import gerrymander
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(tmp_path / "tokens/manifest.json")
    params = SimpleNamespace(paper=SimpleNamespace(), base=SimpleNamespace(tokenize=SimpleNamespace(output=str(tmp_path / "tokens"))))
    with pytest.raises(PipelineError, match="manifest.json"):
        within(lambda: gerrymander(SimpleNamespace(params=params)), fifo)


def test_a_ratio_to_the_paper_is_given_only_where_the_run_is_comparable(project):
    """Issue 51: a d=64 model in CPU processes set against 8x B300 as a "ratio to the paper" (0.758)
    said nothing; the column says why it is not comparable. The H200 runs (GPUs, the paper's
    width or half of it) keep their ratios."""
    from pipeline.paper.report import not_comparable

    gpu = json.loads((H200 / "resident.json").read_text())
    assert not_comparable(gpu) is None
    report = write_report("h200/results", "h200").read_text()
    assert "not comparable:" not in report

    cpu = json.loads(json.dumps(gpu))
    cpu["hardware"] = {"kind": "cpu", "name": "cpu", "count": 2, "memory_gib": None, "capability": None, "describe": "2 CPU processes (gloo)"}
    cpu["scaling"]["model"]["d_model"] = 64
    assert not_comparable(cpu) == "2 CPU processes (gloo) and a d=64 model against the paper's 8x NVIDIA B300 and d=4096"
    narrow = json.loads(json.dumps(gpu))
    narrow["scaling"]["model"]["d_model"] = 512
    assert not_comparable(narrow) == "a d=512 model against the paper's 8x NVIDIA B300 and d=4096"
    (project / "h200/results/resident.json").write_text(json.dumps(cpu))
    (row,) = [line for line in write_report("h200/results", "h200").read_text().splitlines() if line.startswith("| Resident experts")]
    ratio = row.split(" | ")[3]
    assert ratio == "not comparable: 2 CPU processes (gloo) and a d=64 model against the paper's 8x NVIDIA B300 and d=4096", row
