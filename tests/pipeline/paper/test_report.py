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

    for path in Path("h200/results").glob("*.json"):
        text = path.read_text()
        assert '_gib"' not in text  # the committed results are the older kind
        path.write_text(json.dumps(renamed(json.loads(text))))
        assert '_gb"' not in path.read_text()
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
