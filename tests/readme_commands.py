"""Every command the README shows, and where each one is run (tests/test_readme.py holds the
suite; tests/pipeline/test_dvc_e2e.py runs the workspace ones after `moe repro`)."""

import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run here as written.
HERE = {
    ".venv/bin/moe submit --dry-run --nodes 2 --gpus-per-node 8 --tasks-per-node 8 --partition gpu --set train.global_batch_size=128",
    ".venv/bin/moe params --set model.preset=olmoe-1b-7b",
    ".venv/bin/moe params --set recipe=olmoe-1b-7b --set train.max_steps=20000",
    ".venv/bin/moe --version",
    ".venv/bin/moe tasks",
    ".venv/bin/moe plan --gpu h100",
    ".venv/bin/moe plan --gpu h200 --gpus 8 --set parallel.ep=8 --set train.global_batch_size=64 --json",
}
# GPU benchmarks: parsed here (--help), run on the GPU machine.
GPU = {
    "moe bench layer",
    "moe bench experts",
    "moe bench model --layers 12 --accum 8",
    "python -m bench.ep --nproc 2 --parallel ep=1 --parallel ep=2",
    "python -m bench.profile_layer",
    "python -m bench.ep --nproc 2 --sync-debug --parallel ep=1 --parallel ep=2 --parallel ep=2,ep_backend=nvshmem",
    "python -m bench.ep_dispatch --nproc 2",
    "python -m bench.fp8 gemm",
    "python -m bench.memory --write-calibration",
    "python -m bench.determinism --ep",
    "python -m bench.norm",
    "python -m bench.parity run --recipe fp8_rowwise --data data/tokens --out runs/parity/fp8",
    "python -m bench.ep --nproc 1 --parallel ep=1",
    "python -m bench.ep --nproc 2 --parallel ep=1,shard_optimizer=true,overlap_grad_reduce=true",
    "python -m bench.layer --peers ours,gemm,sonic",
    "python -m bench.eval --requests core.json.gz --layers 16",
    "python -m bench.hf_parity --data data/tokens --layers 4 --steps 300",
}
# Run in order after `moe repro` in a clone: tests/pipeline/test_dvc_e2e.py::test_readme_commands_in_a_trained_workspace.
WORKSPACE = [
    ".venv/bin/dvc metrics show",
    ".venv/bin/dvc plots show",
    ".venv/bin/dvc exp run --temp -S ++optim.lr=0.002",
    ".venv/bin/dvc exp run --temp -S +model.d_model=128",
    ".venv/bin/dvc exp show --drop '.*' --keep 'Experiment|Created|optim.lr|model.d_model|final_loss|^val_loss|suite.bpb_mean|suite.primary_mean'",
    ".venv/bin/moe evaluate",
    ".venv/bin/moe release",
    ".venv/bin/moe evaluate --checkpoint runs/train/checkpoints/step_00000100 --checkpoint runs/train/checkpoints/step_00000150",
]
ELSEWHERE = {
    "bench/h200/issue28.sh parity": "the H200 runs of issue 28 (its results are in bench/results/issue28/); its parts run on the CPU in tests/bench",
    "make repro": "the whole pipeline in a fresh venv: CI (.ci/run); its `moe repro` runs in tests/pipeline/test_dvc_e2e.py",
    "make test": "this suite",
    "moe paper repro": "the paper pipeline at CPU scale on the local Slurm cluster: tests/pipeline/paper/test_pipeline.py",
    "moe paper repro --no-dvc": "the same stages without DVC; run on 1 and 2 H200s (bench/paper/NOTES.md)",
    "make ui": "a server: `moe ui` is started and stopped in tests/pipeline/test_cli.py",
    ".venv/bin/moe submit --nodes 2 --gpus-per-node 8 --tasks-per-node 8 --partition gpu --set train.global_batch_size=128": (
        "a 16-GPU Slurm job; submission runs on the local Slurm cluster in tests/pipeline/test_slurm.py"
    ),
    ".venv/bin/moe submit --wait --nodes 2 --gpus-per-node 8 --tasks-per-node 8 --partition gpu --set train.global_batch_size=128": "as above",
    ".venv/bin/moe status 1234": "needs a Slurm job (tests/pipeline/test_slurm.py)",
    ".venv/bin/moe logs 1234 --follow": "needs a Slurm job (tests/pipeline/test_slurm.py)",
    ".venv/bin/moe cancel 1234": "needs a Slurm job (tests/pipeline/test_slurm.py)",
    "make container": "a container builder and the NVIDIA base image (tests/containers/test_image.py builds the CPU variant)",
    "make container BASE_IMAGE=debian:bookworm LOCK=requirements/cpu.lock": "a container builder (tests/containers/test_image.py)",
    "make lock": "rewrites the locks from PyPI; tests/test_locks.py resolves them for every target",
    "make lock-check": "scripts/check_lock.py, run by tests/test_locks.py",
    "PATH=$PWD/.venv/bin:$PATH dvc exp run --queue -S ++optim.lr=0.001": (
        "DVC's queue: tests/pipeline/test_dvc_e2e.py::test_queued_experiment_logs_to_the_project_store"
    ),
    "PATH=$PWD/.venv/bin:$PATH dvc exp run --run-all": "as above",
}


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            cmd = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if cmd:
                out.append(cmd)
    return out


def argv(cmd: str) -> list[str]:
    """The command as run from the repository root with this interpreter's environment."""
    args = shlex.split(cmd)
    if args[0] in ("moe", ".venv/bin/moe"):
        return [sys.executable, "-m", "pipeline.cli", *args[1:]]
    if args[0] == "python":
        return [sys.executable, *args[1:]]
    if args[0].startswith(".venv/bin/"):
        return [str(Path(sys.executable).parent / args[0].rsplit("/", 1)[1]), *args[1:]]
    return args
