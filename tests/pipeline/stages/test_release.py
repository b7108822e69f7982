"""The release stage (issue 50): it takes the conversion record's file names only inside the
converted folder, copies (never links) the converted files, and is never put inside another
stage's output."""

import json
import re
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from tests.workspace import load

TASK = {"acc_v2": 0.31, "acc_v2/stderr": 0.04, "bpb_v2": 2.5, "bpb_v2/stderr": 0.1, "docs": 123.0, "chance": 0.25, "primary": "acc"}
TASK |= {"len_norm_v2": 0.3, "len_norm_v2/stderr": 0.04}


def write_detail(converted: Path, tasks: dict | None = None) -> None:
    """metrics/eval_detail.json as the evaluate stage writes it for the model now in ``converted``
    (its numbers made up: the release only carries them to the card)."""
    from pipeline.stages.evaluate import converted_model_identity

    detail = {"format": "moe-eval/1", "val_loss": 3.0, "step": 8, "tasks": tasks or {"arc_easy": TASK}}
    Path("metrics").mkdir(exist_ok=True)
    Path("metrics/eval_detail.json").write_text(json.dumps({**detail, "converted_sha256": converted_model_identity(converted)}))


def ready_to_release(ws: Path, out: str = "runs/hf") -> None:
    """Convert the workspace's checkpoint into ``out`` and give it an evaluation: what `moe release` needs."""
    from pipeline.stages.convert import convert_to_hf, load_tokens_tokenizer

    convert_to_hf(ws / "runs/train/checkpoints", ws / out, load_tokens_tokenizer(ws / "data/tokens"))
    write_detail(ws / out)


def plant_record_entry(ws: Path, name: str) -> None:
    """A conversion record listing ``name`` (re-evaluated, so only the entry is at fault)."""
    record_path = ws / "runs/hf/moe_conversion.json"
    record = json.loads(record_path.read_text())
    record["written_files"][name] = {"size": 8, "sha256": "0" * 64}
    record_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    write_detail(ws / "runs/hf")


def release(*overrides: str) -> dict:
    from pipeline.model_card import card_text
    from pipeline.stages.release import run_release

    return run_release(load(list(overrides)), card_text)


@pytest.mark.parametrize(
    "entry, words",
    [
        ("../../victim.txt", "is not a relative path inside runs/hf"),
        ("/tmp/victim.txt", "is not a relative path inside runs/hf"),
        ("notes.txt", "is a symlink pointing outside runs/hf"),
    ],
)
def test_a_record_entry_outside_the_converted_folder_is_refused_and_nothing_is_written(ws, entry, words):
    ready_to_release(ws)
    (ws / "runs/victim.txt").write_text("victim original\n")
    (ws / "victim.txt").write_text("the attacker's\n")
    if entry == "notes.txt":
        (ws / "runs/hf/notes.txt").symlink_to(ws / "victim.txt")
    plant_record_entry(ws, entry)
    with pytest.raises(PipelineError, match=re.escape(f"runs/hf/moe_conversion.json: written_files: {entry!r} {words}")):
        release("release.output=runs/deep/release")
    assert (ws / "runs/victim.txt").read_text() == "victim original\n"
    assert not (ws / "runs/deep").exists() or not any((ws / "runs/deep").iterdir())  # no output, no temporary left


def test_a_release_is_a_copy_editing_it_changes_nothing_in_the_conversion(ws):
    from typer.testing import CliRunner

    from pipeline.cli import app

    ready_to_release(ws)
    release()
    converted = {p.name: p.read_bytes() for p in (ws / "runs/hf").iterdir()}
    for name in converted:
        released = ws / "runs/release" / name
        if released.exists():
            assert released.stat().st_ino != (ws / "runs/hf" / name).stat().st_ino and released.stat().st_nlink == 1
    with open(ws / "runs/release/tokenizer_config.json", "w") as f:  # `echo '{}' > ...`: writes through the inode
        f.write("{}\n")
    assert {p.name: p.read_bytes() for p in (ws / "runs/hf").iterdir()} == converted
    r = CliRunner().invoke(app, ["convert", "--no-mlflow"])
    assert r.exit_code == 0, r.output
    write_detail(ws / "runs/hf")  # `moe evaluate` of the new conversion
    # the release refuses to replace a release the user edited (their file), naming it; never runs/hf
    r = CliRunner().invoke(app, ["release"])
    assert r.exit_code != 0 and "release.output: runs/release exists and holds files this stage did not write (tokenizer_config.json" in r.output
    r = CliRunner().invoke(app, ["release", "--set", "release.output=runs/release2"])
    assert r.exit_code == 0, r.output
    assert (ws / "runs/release2/tokenizer_config.json").read_bytes() == converted["tokenizer_config.json"]


@pytest.mark.parametrize(
    "out, words",
    [
        ("runs/hf/release", "is inside convert.output (runs/hf)"),
        ("runs/hf", "is convert.output (runs/hf)"),
        ("data/tokens/release", "is inside tokenize.output (data/tokens)"),
        ("runs/train/release", "is inside executor.run_dir (runs/train)"),
        ("plots/eval/release", "is inside the evaluate stage's plots/eval (plots/eval)"),
        ("runs/release/inner", "is inside runs/release, another stage's output (moe_release.json lists its files)"),
        ("mine/hf/inner", "is inside mine/hf, another stage's output (moe_conversion.json lists its files)"),
        ("plots", "holds the train stage's plots/train (plots/train)"),
    ],
)
def test_a_release_inside_another_output_is_refused_naming_both(ws, out, words):
    ready_to_release(ws)
    release()  # runs/release: an earlier release
    ready_to_release(ws, "mine/hf")  # a conversion with --out elsewhere
    write_detail(ws / "runs/hf")
    with pytest.raises(PipelineError, match=re.escape(f"release.output: {out} {words}")):
        release(f"release.output={out}")
    assert not (ws / out).exists() or out in ("runs/hf", "plots")


# ------------------------------------------- issue 50: the conversion record through moe.reader

PROVENANCE = {"checkpoint": "runs/train/checkpoints/step_00000008", "step": 8, "tokenizer_sha256": "ab" * 32, "dtype": "float32"}


def _converted(tmp_path: Path, **changes) -> Path:
    """A folder with a conversion record as convert_to_hf seals it, with ``changes`` made to it."""
    from pipeline.outputs import seal_output
    from pipeline.stages.convert import MARKER

    hf = tmp_path / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    record = seal_output(hf, MARKER, PROVENANCE)
    (hf / MARKER).write_text(json.dumps({**record, **changes}))
    return hf


def test_the_conversion_record_as_convert_writes_it_reads_back(tmp_path):
    from pipeline.stages.release import read_conversion_record

    record = read_conversion_record(_converted(tmp_path))
    assert record["checkpoint"] == PROVENANCE["checkpoint"] and set(record["written_files"]) == {"config.json"}
    assert read_conversion_record(_converted(tmp_path / "hf-from-hf", step=None, tokenizer_sha256=None))["step"] is None


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"checkpoint": 7}, "checkpoint: expected a string"),
        ({"step": -1}, "step: expected an integer in [0, inf]"),
        ({"dtype": "float16"}, "dtype: expected one of float32, bfloat16"),
        ({"tokenizer_sha256": "abc"}, "tokenizer_sha256: expected a string matching"),
        ({"release": "yes"}, "release: unknown key"),
        ({"written_files": {"config.json": {"size": 2}}}, "written_files.config.json.sha256: missing"),
    ],
)
def test_a_conversion_record_not_of_its_schema_is_one_error_naming_the_field(tmp_path, changes, field):
    from pipeline.stages.release import read_conversion_record

    hf = _converted(tmp_path, **changes)
    with pytest.raises(PipelineError) as exc:
        read_conversion_record(hf)
    message = str(exc.value)
    assert message.startswith(f"convert.output: {hf / 'moe_conversion.json'}: {field}") and "run `moe convert` again" in message
    assert "\n" not in message


def test_a_fifo_as_the_conversion_record_is_refused_at_once(tmp_path):
    from pipeline.stages.release import read_conversion_record
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(tmp_path / "moe_conversion.json")
    with pytest.raises(PipelineError, match=re.escape(f"convert.output: {fifo}: not a regular file")):
        within(lambda: read_conversion_record(tmp_path), fifo)
