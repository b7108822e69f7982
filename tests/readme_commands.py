"""Every command the README and the pages under docs/ show, and where each one is run
(tests/test_readme.py holds the suite; tests/pipeline/test_dvc_e2e.py runs the workspace ones
after `moe repro`). A command is a line of a ```bash block. They are written for the activated
environment (`. .venv/bin/activate`, as the README says once): bare `moe`, `dvc`, `python`."""

import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# What `. .venv/bin/activate` puts first on PATH: this interpreter's environment.
BIN = Path(sys.executable).parent

# Run here as written.
HERE = {
    "moe submit --dry-run --nodes 2 --gpus-per-node 8 --tasks-per-node 8 --partition gpu --set train.global_batch_size=128",
    "moe params --set model.preset=olmoe-1b-7b",
    "moe params --set recipe=olmoe-1b-7b --set train.max_steps=20000",
    "moe --version",
    "moe tasks",
    "moe plan --gpu h100",
    "moe plan --gpu h200 --gpus 8 --set parallel.ep=8 --set train.global_batch_size=64 --json",
    # docs/gpu-quickstart.md: the 8-GPU config, checked and planned without a GPU
    "moe params --set recipe=olmoe-1b-7b --set executor.nprocs=8 --set parallel.ep=8 --set parallel.shard_optimizer=true --set train.max_steps=20000",
    "moe plan --gpu h200 --set recipe=olmoe-1b-7b --set executor.nprocs=8 --set parallel.ep=8 "
    "--set parallel.shard_optimizer=true --set train.max_steps=20000",
}
# GPU commands: parsed here (--help), run on the GPU machine.
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
    # docs/gpu-quickstart.md: the same config as its `moe params`/`moe plan` lines, on 8 GPUs
    "moe train --set recipe=olmoe-1b-7b --set executor.nprocs=8 --set parallel.ep=8 --set parallel.shard_optimizer=true --set train.max_steps=20000",
}
# Run in order after `moe repro` in a clone: tests/pipeline/test_dvc_e2e.py::test_readme_commands_in_a_trained_workspace.
# The order is the order of the pages (the README, then docs/ in the order the README links them).
WORKSPACE = [
    "dvc metrics show",
    "dvc plots show",
    "git add dvc.lock metrics plots",
    'git commit -m "make repro"',
    "dvc exp run --temp -S ++optim.lr=0.002",
    "dvc exp run --temp -S +model.d_model=128",
    "dvc exp show --drop '.*' --keep '^(Experiment|resolved\\.optim\\.lr|resolved\\.model\\.d_model|final_loss|val_loss|bpb_mean)$'",
    "moe evaluate",
    "moe release",
    "moe evaluate --checkpoint runs/train/checkpoints/step_00000100 --checkpoint runs/train/checkpoints/step_00000150",
]
ELSEWHERE = {
    "bench/h200/real_run.sh parity": "the H200 runs of issue 28 (results in bench/results/real_run/); its parts run on the CPU in tests/bench",
    "make repro": "the whole pipeline in a fresh venv: CI (.ci/run); its `moe repro` runs in tests/pipeline/test_dvc_e2e.py",
    "make test": "this suite",
    "make setup-gpu PYTHON=python3": (
        "needs a Python with CUDA torch (>= 2.11) and triton (the target refuses any other); here `make -n` "
        "checks the target, and tests/test_locks.py checks requirements/gpu.lock against pyproject.toml"
    ),
    "moe tokenize": "the tokenize stage of every `moe repro` (tests/pipeline/test_dvc_e2e.py) and tests/pipeline/stages/test_tokenize.py",
    "moe paper repro": "the paper pipeline at CPU scale on the local Slurm cluster: tests/pipeline/paper/test_pipeline.py",
    "moe paper repro --no-dvc": "the same stages without DVC; run on 1 and 2 H200s (bench/paper/NOTES.md)",
    "make ui": "a server: `moe ui` is started and stopped in tests/pipeline/test_cli.py",
    "moe submit --nodes 2 --gpus-per-node 8 --tasks-per-node 8 --partition gpu --set train.global_batch_size=128": (
        "a 16-GPU Slurm job; submission runs on the local Slurm cluster in tests/pipeline/test_slurm.py"
    ),
    "moe submit --wait --nodes 2 --gpus-per-node 8 --tasks-per-node 8 --partition gpu --set train.global_batch_size=128": "as above",
    "moe status 1234": "needs a Slurm job (tests/pipeline/test_slurm.py)",
    "moe logs 1234 --follow": "needs a Slurm job (tests/pipeline/test_slurm.py)",
    "moe cancel 1234": "needs a Slurm job (tests/pipeline/test_slurm.py)",
    "make container": "a container builder and the NVIDIA base image (tests/containers/test_image.py builds the CPU variant)",
    "make container BASE_IMAGE=debian:bookworm LOCK=requirements/cpu.lock": "a container builder (tests/containers/test_image.py)",
    "make lock": "rewrites the locks from PyPI; tests/test_locks.py resolves them for every target",
    "make lock-check": "scripts/check_lock.py, run by tests/test_locks.py",
    "dvc exp run --queue -S ++optim.lr=0.001": ("DVC's queue: tests/pipeline/test_dvc_e2e.py::test_queued_experiment_logs_to_the_project_store"),
    "dvc exp run --run-all": "as above",
    "dvc queue stop": "as above",
}

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def links(path: Path) -> list[str]:
    """The targets of a markdown file's inline links, in order (code spans and blocks left out)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def pages() -> list[Path]:
    """README.md, then the pages under docs/ in the order the README first links them, then any
    page it does not link (tests/test_readme.py fails on those)."""
    ordered = [REPO / "README.md"]
    for target in links(REPO / "README.md"):
        path = (REPO / target.split("#", 1)[0]).resolve()
        if path.suffix == ".md" and path.parent == DOCS and path not in ordered:
            ordered.append(path)
    return ordered + [p for p in sorted(DOCS.glob("*.md")) if p not in ordered]


def page_commands(path: Path) -> list[str]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.splitlines():
            cmd = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if cmd:
                out.append(cmd)
    return out


def readme_commands() -> list[str]:
    """Every command of the README and docs/, page by page, each once (its first place)."""
    return list(dict.fromkeys(cmd for page in pages() for cmd in page_commands(page)))


def argv(cmd: str) -> list[str]:
    """The command as run from the repository root in the activated environment: `moe` is this
    checkout's CLI, `python` this interpreter, and a bare tool the environment holds (`dvc`) is
    the environment's, as `. .venv/bin/activate` puts it first on PATH."""
    args = shlex.split(cmd)
    if args[0] in ("moe", ".venv/bin/moe"):
        return [sys.executable, "-m", "pipeline.cli", *args[1:]]
    if args[0] == "python":
        return [sys.executable, *args[1:]]
    tool = args[0].removeprefix(".venv/bin/")
    if "/" not in tool and (BIN / tool).exists():
        return [str(BIN / tool), *args[1:]]
    return args
