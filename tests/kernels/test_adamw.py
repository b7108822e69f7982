"""The Triton AdamW step (moe.kernels.adamw) under Triton's interpreter (a subprocess: the
interpreter must be chosen before triton is imported): against the update written out, and
through MasterWeightAdamW against torch's fused AdamW (optim.step_kernel)."""

import pytest

from moe.config import ConfigError, OptimizerConfig
from tests.helpers import run_under_triton_interpreter


def test_adamw_kernel_matches_torch_under_the_interpreter():
    run_under_triton_interpreter(["tests/kernels/adamw_check.py"], "adamw kernel ok")


def test_step_kernel_is_validated():
    with pytest.raises(ConfigError, match="step_kernel"):
        OptimizerConfig(step_kernel="cuda").validate()
