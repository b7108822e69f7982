"""A local CPU run whose weights and optimizer state alone exceed the machine's memory is refused
before anything is allocated, with the numbers and what to do."""

import pytest

from moe.config import ExperimentConfig
from moe.errors import PlanError
from moe.plan import host
from moe.plan.accounting import param_counts


def test_the_bound_is_sixteen_bytes_a_parameter_and_the_rope_tables_per_process():
    cfg = ExperimentConfig.load({"model": {"preset": "tiny"}})
    m = cfg.model
    rope = m.n_layers * 2 * m.max_seq_len * m.head_dim * 4
    assert host.host_memory_gib(cfg, 3) == 3 * (16 * param_counts(m).total + rope) / 2**30


def test_a_run_that_cannot_fit_is_refused(monkeypatch):
    cfg = ExperimentConfig.load({"model": {"preset": "olmoe-1b-7b"}})
    monkeypatch.setattr(host, "available_host_gib", lambda: 8.0)
    with pytest.raises(PlanError, match=r"needs at least .* GiB \(2 process\(es\).* but 8\.0 GiB is available here"):
        host.check_host_memory(cfg, 2)
    monkeypatch.setattr(host, "available_host_gib", lambda: None)  # not Linux: nothing to check against
    host.check_host_memory(cfg, 2)
