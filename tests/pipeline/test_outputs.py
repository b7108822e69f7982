"""pipeline.outputs: the ledger vouches for a file only to the writer that wrote it (issue 37)."""

import json

import pytest

from pipeline.errors import PipelineError
from pipeline.outputs import LEDGER, json_keys_within, write_output_file


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
