"""The evaluate stage: ours against transformers, on the trained workspace."""

import json
from pathlib import Path

from tests.workspace import load


def test_evaluation_agrees_with_transformers(in_trained):
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer
    from pipeline.stages.evaluate import run_evaluate

    cfg = load(["convert.output=hf_eval", "evaluate.output=metrics/eval_t.json"])
    convert_to_hf("runs/train/checkpoints", "hf_eval", load_tokens_tokenizer("data/tokens"))
    m = run_evaluate(cfg)
    assert m["hf_rel_diff"] < 1e-4
    assert m["generation_matches_hf"] == 1.0
    assert m["val_perplexity"] > 1 and m["eval_tokens_per_s"] > 0
    written = json.loads(Path("metrics/eval_t.json").read_text())
    assert written["val_loss"] == m["val_loss"]
    assert Path("metrics/eval_t_sample.txt").read_text().startswith("def ")
    assert m["val_windows"] == 4 < m["val_windows_total"]  # evaluate.max_batches=2 of batch 2: named as a subset

    whole = run_evaluate(load(["convert.output=hf_eval", "evaluate.output=metrics/eval_w.json", "evaluate.max_batches=null"]))
    assert whole["val_windows"] == whole["val_windows_total"] == m["val_windows_total"]
    assert whole["val_tokens"] > m["val_tokens"]


def test_downstream_tasks_in_eval_json_with_transformers_beside(in_trained):
    """Issue 27: per task, OLMo's metrics for ours, transformers' headline beside (they agree), the
    documents counted (of the task's total), chance next to accuracy; the figure; MLflow's flat keys."""
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer
    from pipeline.stages.evaluate import flat_metrics, run_evaluate

    if not Path("hf_eval").is_dir():
        convert_to_hf("runs/train/checkpoints", "hf_eval", load_tokens_tokenizer("data/tokens"))
    m = run_evaluate(load(["convert.output=hf_eval", "evaluate.output=metrics/eval_d.json"]))
    summary = json.loads(Path("metrics/eval_d.json").read_text())  # the DVC metric: numbers a table shows
    assert set(summary) == {"step", "val_loss", "val_perplexity", "hf_rel_diff", "generation_matches_hf", "suite"}
    assert summary["suite"]["bpb_mean"] == m["suite"]["bpb_mean"] and summary["suite"]["tasks"] == 3
    assert all(isinstance(v, (int, float)) for v in [*summary.values(), *summary["suite"].values()] if not isinstance(v, dict))
    written = json.loads(Path("metrics/eval_d_detail.json").read_text())
    assert written["format"] == "moe-eval/1" and set(written["tasks"]) == {"arc_easy", "winogrande", "mmlu_stem_mc_5shot"}
    arc = written["tasks"]["arc_easy"]
    assert arc["primary"] == "acc" and arc["docs"] == 8 and arc["docs_total"] == 570 and 0.2 < arc["chance"] < 0.3
    assert arc["hf"]["bpb"] == __import__("pytest").approx(arc["bpb_v2"], rel=1e-4) and arc["hf_rel_diff"] < 1e-4
    for key in ("acc_v2", "len_norm_v2", "bpb_v2", "ce_loss_v2", "soft_v2"):
        assert key in arc, key
    assert written["tasks"]["mmlu_stem_mc_5shot"]["primary"] == "len_norm"
    assert written["suite"]["tasks"] == 3 and written["suite"]["docs"] == 24
    assert Path("plots/eval/downstream.png").read_bytes().startswith(b"\x89PNG")
    flat = flat_metrics(m)
    assert "task/arc_easy/bpb_v2" in flat and "task/arc_easy/hf_bpb" in flat and "suite/bpb_mean" in flat
    # issue 40: a standard error beside every metric, the sampled documents, the truncation counts
    n, p = arc["docs"], arc["acc_v2"]
    assert arc["acc_v2/stderr"] == __import__("pytest").approx((p * (1 - p) / n) ** 0.5)
    assert arc["bpb_v2/stderr"] > 0 and "bpb_mean/stderr" in summary["suite"] and "acc_mean/stderr" in summary["suite"]
    assert "task/arc_easy/acc_v2/stderr" in flat and "task/arc_easy/hf_bpb/stderr" in flat and "suite/bpb_mean/stderr" in flat
    assert arc["sample_seed"] == 0 and len(arc["doc_ids"]) == 8 and arc["doc_ids"] == sorted(arc["doc_ids"])
    assert arc["doc_ids"] != list(range(8))  # a random sample, not the first documents
    mmlu = written["tasks"]["mmlu_stem_mc_5shot"]
    # issue 51: a majority baseline beside chance; MMLU over its subjects; one kind of accuracy per suite mean
    assert 0.25 <= arc["majority"] <= 1 and "primary_mean" not in summary["suite"] and "len_norm_mean" in summary["suite"]
    assert mmlu["subjects"] >= 1 and "len_norm_v2_macro" in mmlu and "mmlu_mc_5shot_macro" in written["suite"]
    same = arc["ours_on_hf_docs"]  # ours over transformers' documents: what the figure sets beside it
    assert same["docs"] == arc["hf"]["docs"] and same["bpb"] == __import__("pytest").approx(arc["hf"]["bpb"], rel=1e-4)
    assert mmlu["truncated_docs"] >= 1 and mmlu["truncated_tokens_max"] >= 1 and mmlu["dropped_docs"] == 0  # 5-shot vs 32 positions
    assert arc["truncated_requests"] <= arc["requests"]
    # issue 51: where this config cuts contexts, the count stands beside the numbers: in the DVC
    # metric's suite, MLflow's task keys and, per task, on the release's card
    cut = sum(t["truncated_docs"] for t in written["tasks"].values())
    assert summary["suite"]["truncated_docs"] == cut and "dropped_docs" not in summary["suite"]
    assert flat["task/mmlu_stem_mc_5shot/truncated_docs"] == mmlu["truncated_docs"] and flat["suite/truncated_docs"] == cut
    from pipeline.model_card import card_text
    from pipeline.stages.release import run_release

    run_release(load(["convert.output=hf_eval", "evaluate.output=metrics/eval_d.json", "release.output=release_d"]), card_text)
    card = Path("release_d/README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| mmlu_stem_mc_5shot | len_norm |"))
    assert row.split(" | ")[5] == f"{mmlu['truncated_docs']:.0f} (up to {mmlu['truncated_tokens_max']:.0f} tokens)", row
    assert f"mmlu_stem_mc_5shot {mmlu['truncated_docs']:.0f} (up to" in card.split("## Limitations")[1]


def test_evaluate_defaults_to_the_whole_split():
    from pipeline.params import EvaluateConfig

    assert EvaluateConfig().max_batches is None


def test_checkpoints_evaluated_without_conversion_give_a_curve(ws):
    """`moe evaluate --checkpoint A --checkpoint B`: our model at each step, validation loss and the
    tasks, in <output>_checkpoints.json (sorted by step), MLflow (one metric per step) and a figure."""
    from mlflow.tracking import MlflowClient

    from tests.helpers import moe

    r = moe(
        "evaluate",
        "--checkpoint",
        "runs/train/checkpoints/step_00000008",
        "--checkpoint",
        "runs/train/checkpoints/step_00000004",
        "--set",
        "evaluate.tasks=[arc_easy, piqa]",
        "--set",
        "evaluate.limit=6",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    said = r.stdout + r.stderr
    assert "step 4: val loss" in said and "step 8: val loss" in said and "piqa bpb" in said
    curve = json.loads(Path("metrics/eval_checkpoints.json").read_text())
    assert [p["step"] for p in curve["points"]] == [4, 8]
    assert set(curve["points"][0]["tasks"]) == {"arc_easy", "piqa"} and "bpb" in curve["points"][0]["tasks"]["piqa"]
    assert Path("plots/checkpoints/checkpoints.png").read_bytes().startswith(b"\x89PNG")
    assert not Path("metrics/eval.json").exists()  # the stage's own output is untouched
    client = MlflowClient("sqlite:///mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("moe").experiment_id], "tags.`moe.stage` = 'evaluate-checkpoints'")[0]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "task/piqa/bpb")] == [4, 8]


def test_an_unknown_task_is_one_error_before_any_work(ws):
    from tests.helpers import moe

    for command in (["evaluate"], ["train", "--set", "train.max_steps=12"]):
        key = "evaluate.tasks" if command == ["evaluate"] else "train.eval_tasks"
        r = moe(*command, "--no-mlflow", "--set", f"{key}=[arc_easy, helaswag]")
        assert r.returncode != 0
        lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and f"error: {key}: unknown task 'helaswag' (did you mean hellaswag" in lines[0], r.stderr
        assert "known: the suites" in lines[0]
    assert not Path("metrics/eval.json").exists()
    assert json.loads(Path("runs/train/metrics.jsonl").read_text().splitlines()[-1])["step"] == 8  # no step trained
