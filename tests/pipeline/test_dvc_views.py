"""What DVC shows of the pipeline (issue 51): `dvc metrics show` and the docs' `dvc exp show`
within 120 columns, the recipe's values as columns, and the paper pipeline apart from the
main one. One small git+DVC project of this checkout's dvc.yaml files (no stage runs: the
stages' outputs are written here as the stages write them); the real run's tables are held by
tests/pipeline/test_dvc_e2e.py::test_readme_commands_in_a_trained_workspace."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.dvc_views import EVAL_HEADLINE, RESOLVED_PARAMS, TRAIN_HEADLINE, TRAIN_SECTIONS, headline, write_headline, write_resolved_params
from tests.readme_commands import WORKSPACE
from tests.workspace import REPO

DVC = Path(sys.executable).parent / "dvc"
COLUMNS = 120
EXPERIMENT_ROW = "└── 1234567 [abcde-abcd]"
FILES = ("dvc.yaml", "params.yaml", ".dvcignore", ".dvc/config") + tuple(
    f"bench/paper/{f}" for f in ("dvc.yaml", "params.yaml", ".dvcignore", ".dvc/config", ".dvc/.gitignore", ".gitignore")
)
# a GPU run's figures are as wide as they get: a throughput of seven digits
TRAIN = {"steps": 20000, "final_loss": 2.718281828459045, "tokens_per_s": 1234567.891, "mfu": 0.41}
EVAL = {"val_loss": 2.9379286095799, "val_perplexity": 18.87531, "suite": {"bpb_mean": 1.0592593993, "len_norm_mean": 0.28099999999, "acc_mean": 0.3}}


def git(*args, cwd):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True)


def dvc(*args, cwd) -> str:
    env = {**os.environ, "COLUMNS": "400"}  # a wide terminal: DVC cuts no column
    r = subprocess.run([str(DVC), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def width(table: str) -> int:
    return max(len(line) for line in table.splitlines())


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The dvc.yaml files of this checkout, the train and evaluate stages' DVC views written as
    those stages write them, committed."""
    from pipeline.params import load_params

    root = tmp_path_factory.mktemp("dvc-views")
    for f in FILES:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, root / f)
    old = os.getcwd()
    os.chdir(root)
    try:
        write_headline("metrics/train.json", TRAIN, TRAIN_HEADLINE)
        write_headline("metrics/eval.json", EVAL, EVAL_HEADLINE)
        write_resolved_params(load_params(Path("params.yaml")).flatten())
    finally:
        os.chdir(old)
    git("init", "-q", cwd=root)
    git("add", "-A", cwd=root)
    git("commit", "-qm", "a run", cwd=root)
    return root


def test_metrics_show_fits_120_columns(project):
    table = dvc("metrics", "show", cwd=project)
    assert width(table) <= COLUMNS, table
    assert {"final_loss", "tokens_per_s", "val_loss", "val_perplexity", "bpb_mean", "len_norm_mean"} <= set(table.split()), table
    assert "1234568" in table  # a throughput is a whole number


def test_the_docs_exp_show_fits_120_columns_with_the_recipes_values(project):
    """The committed run and the workspace, each with the learning rate the recipe gave it (not
    in params.yaml); an experiment's row label is at most EXPERIMENT_ROW wide (DVC names them
    adjective-noun, at most 5 + 4 letters), which the first column grows to."""
    (cmd,) = [c for c in WORKSPACE if c.startswith("dvc exp show")]
    lr = yaml.safe_load((project / RESOLVED_PARAMS).read_text())["resolved"]["optim"]["lr"]
    table = dvc(*shlex.split(cmd)[1:], cwd=project)
    assert width(table) + len(EXPERIMENT_ROW) - len("Experiment") <= COLUMNS, table
    header = table.split()[1:7]  # (DVC puts the metrics first, then the params)
    assert sorted(header) == sorted(["Experiment", "resolved.optim.lr", "resolved.model.d_model", "final_loss", "val_loss", "bpb_mean"]), table
    rows = [line.split() for line in table.splitlines() if line.split() and line.split()[0] in ("workspace", "main", "master")]
    assert len(rows) == 2 and all(row[header.index("resolved.optim.lr")] == str(lr) and "!" not in row for row in rows), table


def test_train_writes_the_sections_its_stage_reads():
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]
    assert tuple(stage["params"]) == TRAIN_SECTIONS


def test_headline_takes_nested_figures_by_their_last_name():
    assert headline(EVAL, EVAL_HEADLINE) == {
        "val_loss": EVAL["val_loss"],
        "val_perplexity": 18.87531,
        "bpb_mean": 1.0592593993,
        "len_norm_mean": 0.28099999999,
    }
    assert headline({"final_loss": None}, TRAIN_HEADLINE) == {"final_loss": None}  # the required key stays (null), an absent one goes


def test_the_paper_pipeline_is_a_dvc_project_of_its_own(project):
    """Its outputs (here as `moe paper repro --no-dvc` leaves them) never show in the main
    pipeline's `dvc status`; its own status, in bench/paper, lists its stages."""
    (project / "bench/paper/results").mkdir()
    (project / "bench/paper/results/resident.json").write_text("{}\n")
    (project / "bench/paper/REPORT.md").write_text("# report\n")
    main = dvc("status", cwd=project)
    assert "claim@" not in main and "paper" not in main and "train:" in main, main
    paper = dvc("status", cwd=project / "bench/paper")
    assert "claim@resident" in paper and "report" in paper, paper
