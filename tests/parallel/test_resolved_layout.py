"""A layout takes the layout its job resolved (ExperimentConfig.resolve, once per run) and checks
only that it was resolved for this world."""

import pytest
import torch

from moe.config import ConfigError
from moe.parallel.env import DistEnv
from moe.parallel.layout import FsdpLayout, ParallelLayout, build_layout
from tests.helpers import tiny_config

ONE = DistEnv(0, 1, 0, torch.device("cpu"))


@pytest.mark.parametrize("parallel", [{}, {"data_parallel": "fsdp"}], ids=["ddp", "fsdp"])
def test_a_layout_refuses_a_layout_resolved_for_another_world(tmp_path, parallel):
    cfg = tiny_config(tmp_path, tmp_path / "ck", parallel=parallel, train={"global_batch_size": 4, "micro_batch_size": 2})
    make = FsdpLayout if parallel else ParallelLayout
    with pytest.raises(ConfigError) as info:
        make(cfg, ONE, cfg.resolve(2))
    assert (
        str(info.value) == "parallel: the job's layout was resolved for world size 2, but this run has world size 1 (rebuild the job for this world)"
    )


@pytest.mark.parametrize("parallel", [{}, {"data_parallel": "fsdp"}], ids=["ddp", "fsdp"])
def test_a_layout_takes_the_resolved_layout_it_is_given(tmp_path, parallel):
    cfg = tiny_config(tmp_path, tmp_path / "ck", parallel=parallel)
    resolved = cfg.resolve(1)
    layout = build_layout(cfg, ONE, resolved)
    assert layout.resolved is resolved
    assert build_layout(cfg, ONE).resolved == resolved  # none given: the config resolved against this world
