"""The checks on what reaches Slurm's commands and the batch script, without a cluster (issue
50, items 3 and 4; the commands themselves against a real Slurm: test_slurm.py)."""

import re

import pytest

from pipeline.errors import PipelineError
from pipeline.executors.slurm import SlurmExecutor, check_job_id, check_script_paths, check_script_value
from pipeline.params import ContainerConfig, SlurmConfig


@pytest.mark.parametrize("job_id", ["1", "12345", "12345_7", "12345_[1-3]", "12345_[1,4-6]", "12345+1"])
def test_slurm_job_ids_are_accepted(job_id):
    assert check_job_id(job_id) == job_id


@pytest.mark.parametrize("job_id", ["--me", "-1", "", "12 34", "123;id", "123\n", "../x", "123_", "123_[]", "123_[1-]", "0x12", "１２"])
def test_anything_else_is_refused_naming_it(job_id):
    with pytest.raises(PipelineError, match=re.escape(f"job id: {job_id!r} is not a Slurm job id")):
        check_job_id(job_id)


def test_log_paths_take_only_a_job_id():
    ex = SlurmExecutor(SlurmConfig(), ContainerConfig())
    assert ex.log_paths("77")[0].name == "77_0_log.out"
    with pytest.raises(PipelineError, match="is not a Slurm job id"):
        ex.log_paths("../../etc/passwd")


@pytest.mark.parametrize("char", ["\n", "\x1b", "\u202e", "\u200b", "\u2028"])
def test_a_path_with_a_control_or_bidi_character_is_refused(char):
    with pytest.raises(PipelineError, match=f"the working directory: .* contains U\\+{ord(char):04X}"):
        check_script_value(f"/home/a{char}b", "the working directory")


def test_a_working_directory_that_would_split_the_container_mount_is_refused(tmp_path, monkeypatch):
    odd = tmp_path / "a,b"
    odd.mkdir()
    monkeypatch.chdir(odd)
    check_script_paths(SlurmConfig(), ContainerConfig())  # on the host: no mount to split
    with pytest.raises(PipelineError, match="contains ',' or ':', which would split the repository's container mount"):
        check_script_paths(SlurmConfig(), ContainerConfig(runtime="pyxis", image="img.sqsh"))
