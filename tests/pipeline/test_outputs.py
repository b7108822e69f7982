"""pipeline.outputs: the ledger vouches for a file only to the writer that wrote it (issue 37); a
name a record lists stays inside its folder, and a copy shares nothing with its source (issue 50)."""

import json
import os
import re

import pytest

from pipeline.errors import PipelineError
from pipeline.outputs import LEDGER, check_own_output, json_keys_within, seal_output, write_output_file


def test_another_writers_file_in_the_same_folder_is_not_ours(tmp_path):
    train = tmp_path / "metrics/train.json"
    write_output_file(train, '{"final_loss": 3.0}\n', "metrics/train.json")
    write_output_file(train, '{"final_loss": 2.9}\n', "metrics/train.json")  # the same writer replaces its own
    with pytest.raises(PipelineError, match="not written by this stage"):
        write_output_file(train, '{"val_loss": 3.0}\n', "evaluate.output")
    assert json.loads(train.read_text()) == {"final_loss": 2.9}
    assert json.loads((tmp_path / "metrics" / LEDGER).read_text())["train.json"]["by"] == "metrics/train.json"


def test_a_ledger_entry_of_the_older_form_vouches_for_nothing(tmp_path):
    out = tmp_path / "eval.json"
    out.write_text('{"val_loss": 3.2}\n')
    from pipeline.outputs import sha256_file

    (tmp_path / LEDGER).write_text(json.dumps({"eval.json": sha256_file(out)}))
    with pytest.raises(PipelineError, match="not written by this stage"):
        write_output_file(out, "{}", "evaluate.output")
    recognise = json_keys_within({"val_loss", "val_perplexity"}, {"val_loss", "val_perplexity"})
    with pytest.raises(PipelineError):  # a user's one-key file does not pass for our two-key one
        write_output_file(out, "{}", "evaluate.output", recognise)
    out.write_text('{"val_loss": 3.2, "val_perplexity": 24.5}\n')
    write_output_file(out, '{"val_loss": 3.1, "val_perplexity": 22.2}\n', "evaluate.output", recognise)


# ------------------------------------------------ issue 50: names a record holds, copies


def test_inside_takes_a_normal_name_and_a_nested_one(tmp_path):
    from pipeline.outputs import inside

    (tmp_path / "out/train").mkdir(parents=True)
    assert inside(tmp_path / "out", "config.json", "record: written_files") == tmp_path / "out/config.json"
    assert inside(tmp_path / "out", "train/part-00000.npy", "record: written_files") == tmp_path / "out/train/part-00000.npy"
    (tmp_path / "out/real.bin").write_bytes(b"x")
    (tmp_path / "out/link.bin").symlink_to("real.bin")  # a link that stays inside is a name inside
    assert inside(tmp_path / "out", "link.bin", "record: written_files") == tmp_path / "out/link.bin"


@pytest.mark.parametrize(
    "name, words",
    [
        ("../mine/notes.txt", "is not a relative path inside"),
        ("train/../../mine/notes.txt", "is not a relative path inside"),
        ("/etc/passwd", "is not a relative path inside"),
        ("a//b", "is not a relative path inside"),
        ("", "is not a file name inside"),
        (7, "is not a file name inside"),
        ("a\\..\\b", "is not a file name inside"),
    ],
)
def test_inside_refuses_dotdot_absolute_and_odd_names_naming_the_record_and_entry(tmp_path, name, words):
    from pipeline.outputs import inside

    with pytest.raises(PipelineError, match=re.escape(f"runs/hf/moe_conversion.json: written_files: {name!r} {words}")):
        inside(tmp_path / "out", name, "runs/hf/moe_conversion.json: written_files")


def test_inside_refuses_a_symlink_out_of_the_folder(tmp_path):
    from pipeline.outputs import inside

    (tmp_path / "mine").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out/weights.bin").symlink_to(tmp_path / "mine/notes.txt")
    (tmp_path / "out/sub").symlink_to(tmp_path / "mine")  # a folder on the way out
    for name in ("weights.bin", "sub/notes.txt"):
        with pytest.raises(PipelineError, match=re.escape(f"record: written_files: {name!r} is a symlink pointing outside")):
            inside(tmp_path / "out", name, "record: written_files")


def test_a_record_listing_a_name_outside_its_folder_is_not_ours(tmp_path):
    """check_own_output reads every entry through inside(): such an output is refused, by entry."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    seal_output(out, "moe_conversion.json", {})
    record = json.loads((out / "moe_conversion.json").read_text())
    record["written_files"]["../notes.txt"] = {"size": 1, "sha256": "0" * 64}
    (out / "moe_conversion.json").write_text(json.dumps(record))
    with pytest.raises(PipelineError, match=re.escape("moe_conversion.json: written_files: '../notes.txt' is not a relative path inside")):
        check_own_output(out, "moe_conversion.json", "convert.output")


def test_a_clone_shares_nothing_with_its_source(tmp_path):
    from pipeline.outputs import clone_file

    src = tmp_path / "model.safetensors"
    src.write_bytes(b"\0weights" * 1000)
    src.chmod(0o600)
    dst = tmp_path / "copy.safetensors"
    clone_file(src, dst)
    assert dst.read_bytes() == src.read_bytes() and dst.stat().st_mode & 0o777 == 0o600
    assert dst.stat().st_ino != src.stat().st_ino and src.stat().st_nlink == 1
    dst.write_bytes(b"edited")
    assert src.read_bytes() == b"\0weights" * 1000
    with pytest.raises(FileExistsError):  # never over an existing file
        clone_file(src, dst)


def test_a_clone_falls_back_to_an_in_kernel_copy_then_to_read_and_write(tmp_path, monkeypatch):
    import errno
    import os

    from pipeline import outputs

    src = tmp_path / "a.bin"
    src.write_bytes(bytes(range(256)) * 5000)
    monkeypatch.setattr(outputs, "_reflink", lambda src_fd, dst_fd: False)  # a filesystem without clones (ext4)
    outputs.clone_file(src, tmp_path / "b.bin")
    assert (tmp_path / "b.bin").read_bytes() == src.read_bytes()

    def no_copy_range(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", no_copy_range)
    outputs.clone_file(src, tmp_path / "c.bin")
    assert (tmp_path / "c.bin").read_bytes() == src.read_bytes()


def test_enclosing_output_finds_the_stage_record_above_a_path(tmp_path):
    from pipeline.outputs import enclosing_output

    out = tmp_path / "runs/release"
    out.mkdir(parents=True)
    (out / "model.bin").write_bytes(b"x")
    seal_output(out, "moe_release.json", {})
    (tmp_path / "manifest.json").write_text('{"name": "my web app"}')  # not a stage's record
    names = ("moe_release.json", "manifest.json")
    assert enclosing_output(out / "inner/deeper", names) == out / "moe_release.json"
    assert enclosing_output(tmp_path / "runs/elsewhere", names) is None


# ------------------------------------------------ issue 50: the ledger and records through moe.reader

HEX = "ab" * 32


def test_a_fifo_in_place_of_the_ledger_is_refused_at_once_before_anything_is_written(tmp_path):
    """Issue 50 item 8: a FIFO as metrics/.moe-outputs.json hung `moe train` and `moe evaluate`."""
    from pipeline.outputs import _read_ledger, check_output_file
    from tests.pipeline.fifo import fifo_at, within

    fifo = fifo_at(tmp_path / "metrics" / LEDGER)
    words = re.escape(f"metrics/train.json: {fifo}: not a regular file (the ledger of the outputs written in {tmp_path / 'metrics'}")
    with pytest.raises(PipelineError, match=words):
        within(lambda: _read_ledger(tmp_path / "metrics", "metrics/train.json"), fifo)
    with pytest.raises(PipelineError, match=words):  # the output is absent: refused all the same, before any work
        within(lambda: check_output_file(tmp_path / "metrics/train.json", "metrics/train.json"), fifo)
    (tmp_path / "metrics/train.json").write_text('{"final_loss": 3.0}\n')
    with pytest.raises(PipelineError, match=words):
        within(lambda: write_output_file(tmp_path / "metrics/train.json", '{"final_loss": 2.0}\n', "metrics/train.json"), fifo)
    assert (tmp_path / "metrics/train.json").read_text() == '{"final_loss": 3.0}\n' and fifo.is_fifo()


@pytest.mark.parametrize(
    "text, field",
    [
        (json.dumps({"train.json": {"sha256": 7, "by": "metrics/train.json"}}), "train.json: expected a {sha256, by} entry or a bare sha256"),
        (json.dumps({"train.json": {"sha256": HEX, "by": "k", "mode": "w"}}), "train.json: expected a {sha256, by} entry or a bare sha256"),
        (json.dumps({"train.json": "not a digest"}), "train.json: expected a {sha256, by} entry or a bare sha256"),
        (json.dumps({"../train.json": HEX}), "the file key: expected a string matching"),
        ('{"train.json": NaN}', "not valid JSON (NaN is not a number JSON allows"),
        ("[]", "the file: expected a mapping"),
    ],
)
def test_a_ledger_not_of_our_schema_is_one_error_naming_the_entry(tmp_path, text, field):
    (tmp_path / LEDGER).write_text(text)
    (tmp_path / "train.json").write_text('{"final_loss": 3.0}\n')
    with pytest.raises(PipelineError) as exc:
        write_output_file(tmp_path / "train.json", "{}", "metrics/train.json")
    message = str(exc.value)
    assert message.startswith(f"metrics/train.json: {tmp_path / LEDGER}: ") and field in message and "\n" not in message
    assert (tmp_path / "train.json").read_text() == '{"final_loss": 3.0}\n'


def test_recognisers_say_not_ours_at_once_for_a_fifo_a_huge_or_a_broken_file(tmp_path):
    from pipeline.outputs import _lists_written_files, csv_header
    from tests.pipeline.fifo import fifo_at, within

    recognise_json = json_keys_within({"val_loss", "step"}, {"val_loss"})
    recognise_csv = csv_header(["step", "loss"])
    fifo = fifo_at(tmp_path / "eval.json")
    assert within(lambda: recognise_json(fifo), fifo) is False
    assert within(lambda: recognise_csv(fifo), fifo) is False
    assert within(lambda: _lists_written_files(fifo), fifo) is False
    good = tmp_path / "loss.csv"
    good.write_bytes(b"step,loss\r\n1,3.0\r\n")
    assert recognise_csv(good) and not csv_header(["step", "loss"], max_bytes=8)(good)
    (tmp_path / "eval.json").unlink()
    (tmp_path / "eval.json").write_text('{"val_loss": 3.0, "step": 8}')
    assert recognise_json(tmp_path / "eval.json") and not json_keys_within({"val_loss"}, "val_loss", max_bytes=8)(tmp_path / "eval.json")
    (tmp_path / "eval.json").write_text('{"val_loss": NaN}')
    assert recognise_json(tmp_path / "eval.json") is False
    (tmp_path / "record.json").write_text('{"written_files": []}')
    assert _lists_written_files(tmp_path / "record.json") is False


def _sealed(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    seal_output(out, "moe_conversion.json", {"checkpoint": "ck"})
    return out


@pytest.mark.parametrize(
    "entry, field",
    [
        ({"size": "2", "sha256": HEX}, "written_files.config.json.size: expected an integer"),
        ({"size": -1, "sha256": HEX}, "written_files.config.json.size: expected an integer in [0, inf]"),
        ({"size": 2, "sha256": "00"}, "written_files.config.json.sha256: expected a string matching"),
        ({"size": 2, "sha256": HEX, "mode": 420}, "written_files.config.json.mode: unknown key"),
    ],
)
def test_a_record_whose_entries_are_not_ours_is_refused_naming_the_field(tmp_path, entry, field):
    out = _sealed(tmp_path)
    record = json.loads((out / "moe_conversion.json").read_text())
    record["written_files"]["config.json"] = entry
    (out / "moe_conversion.json").write_text(json.dumps(record))
    with pytest.raises(PipelineError, match=re.escape(f"(moe_conversion.json does not list the files this stage wrote ({field}")):
        check_own_output(out, "moe_conversion.json", "convert.output")


def test_a_fifo_as_the_record_or_inside_the_output_is_refused_at_once(tmp_path):
    from tests.pipeline.fifo import fifo_at, within

    out = _sealed(tmp_path)
    fifo = fifo_at(out / "weights.bin")
    record = json.loads((out / "moe_conversion.json").read_text())
    record["written_files"]["weights.bin"] = {"size": 0, "sha256": HEX}  # a FIFO's size: only hashing it would tell
    (out / "moe_conversion.json").write_text(json.dumps(record))
    with pytest.raises(PipelineError, match=re.escape("(weights.bin (not a regular file))")):
        within(lambda: check_own_output(out, "moe_conversion.json", "convert.output"), fifo)
    fifo.unlink()
    fifo = fifo_at(out / "moe_conversion.json")
    with pytest.raises(PipelineError, match=re.escape("(no moe_conversion.json)")):
        within(lambda: check_own_output(out, "moe_conversion.json", "convert.output"), fifo)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700), (0o002, 0o775)])
def test_an_output_folder_follows_the_umask(tmp_path, umask, mode):
    """A stage's output folder is made under a private temporary name, then renamed into place:
    it ends with the permissions the user's umask gives a new folder, not mkdtemp's 0700."""
    from pipeline.outputs import fresh_temp_dir

    old = os.umask(umask)
    try:
        made = fresh_temp_dir(tmp_path / "release")
    finally:
        os.umask(old)
    assert made.stat().st_mode & 0o777 == mode
