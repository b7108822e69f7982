"""The warp-specialised wgrad kernel (moe/kernels/grouped_wgrad_ws.py) compiled for sm90 here:
wgmma from shared memory, register reallocation between the partitions, no spills, within an sm90
block's shared memory, the operands and the old sum through TMA. Its results are checked on the
GPU (tests/kernels/grouped_wgrad_ws_gpu_check.py); where it does not apply, the Triton kernel
serves (CPU, interpreter)."""

import re

import pytest
import torch

pytest.importorskip("triton")

from moe.kernels import grouped_wgrad_ws as ws  # noqa: E402

needs_gluon = pytest.mark.skipif(not ws.HAVE_GLUON, reason="this Triton has no Gluon")


@needs_gluon
@pytest.mark.parametrize("config", list(ws.CONFIGS))
@pytest.mark.parametrize("accumulator", ["*fp32", "*bf16"])
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("squares", [False, True])
def test_the_ws_kernel_compiles_for_sm90_warp_specialised_without_spills(config, accumulator, accumulate, paired, squares):
    from tests.kernels.sm90 import compile_for_sm90

    block_m, block_n, block_k, stages, lead = ws.CONFIGS[config]
    stats = compile_for_sm90(
        ws._grouped_wgrad_ws_kernel,
        {
            "grad": "*bf16",
            "x": "*bf16",
            "ends": "*i32",
            "grad2": "*bf16",
            "x2": "*bf16",
            "ends2": "*i32",
            "order": "*i32",
            "out": accumulator,
            "sq": "*fp32",
            "G": "i32",
            "M": "i32",
            "K": "i32",
        },
        {
            "ACCUMULATE": accumulate,
            "ORDERED": True,
            "PAIRED": paired,
            "SQUARES": squares,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k,
            "STAGES": stages,
            "LEAD": lead,
            "CONSUMER_REGS": ws.CONSUMER_REGS,
        },
        num_warps=4,
        maxnreg=ws.MAX_REGS,
        return_ptx=True,
    )
    assert stats["wgmma"] and stats["spill_stack_bytes"] == 0 and stats["local_bytes"] == 0, {k: v for k, v in stats.items() if k != "ptx"}
    assert stats["shared_bytes"] <= 227 * 1024, stats["shared_bytes"]
    assert "setmaxnreg" in stats["ptx"], "the consumers take the registers the producer does not need"
    loads = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", stats["ptx"]))  # ::cluster or ::cta by version
    assert loads >= (3 if accumulate else 2) + (2 if paired else 0), "operand loads (the pair's too, and the old sum's when accumulating) through TMA"


def test_it_declines_what_it_cannot_take():
    """CPU tensors (a pair's too) go to the Triton kernel."""
    grad, x = torch.zeros(8, 256, dtype=torch.bfloat16), torch.zeros(8, 128, dtype=torch.bfloat16)
    out = torch.zeros(2, 256, 128)
    assert not ws.supports(grad, x, out)
    assert not ws.supports(grad, x, out, pair=(grad, x, torch.tensor([4, 8])))


def test_it_is_the_default_and_a_bad_switch_names_itself():
    """Unset, MOE_WGRAD_KERNEL picks this kernel where it applies; a value that is neither 'ws' nor
    'triton' stops the import with one line naming the variable."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MOE_WGRAD_KERNEL"}
    probe = "from moe.kernels import grouped_wgrad_ws as ws; print(ws.USE_WS)"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.strip() == "True"
    env["MOE_WGRAD_KERNEL"] = "triton"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.strip() == "False"
    env["MOE_WGRAD_KERNEL"] = "cutlass"
    bad = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "MOE_WGRAD_KERNEL='cutlass'" in bad.stderr
