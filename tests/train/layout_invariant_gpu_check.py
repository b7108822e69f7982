"""On one CUDA device: train.layout_invariant at dp = 4, 2 and 1 (four, two and one processes
sharing the GPU over gloo, which carries CUDA tensors where NCCL refuses two ranks on one device)
and the resumes from dp=4's step 10, bitwise, with the default mode at dp=4 against dp=1 as the
control. What tests/train/test_layout_invariant.py holds on CPU, with the CUDA kernels (the
Triton fixed-point sums, cuBLAS in its deterministic mode) in the loop.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 [FLAVOURS=ddp,zero1,fsdp] python tests/train/layout_invariant_gpu_check.py [out.json]

Prints one line per flavour and comparison and writes them as JSON; exits 1 when any differs."""

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

import tests.train.test_layout_invariant as cpu
from moe.parallel.spawn import run_ranks
from tests.helpers import make_corpus, tiny_config


def on_cuda(data_dir, ckpt_dir, **sections):
    sections["train"] = {**sections.get("train", {}), "device": "cuda"}
    if sections.get("parallel", {}).get("data_parallel") == "fsdp":  # FSDP keeps fp32 shards (bf16: refused)
        sections["precision"] = {"recipe": "amp_bf16"}
    return tiny_config(data_dir, ckpt_dir, **sections)


def ranks(rank: int, world: int, root: str, corpus: str, flavours: list[str]) -> None:
    os.environ["LOCAL_RANK"] = "0"  # every rank on the one GPU
    cpu.tiny_config = on_cuda
    cpu.FLAVOURS = {k: v for k, v in cpu.FLAVOURS.items() if k in flavours}
    cpu.ranks(rank, world, root, corpus)


def compare(root: Path, figures: dict, flavour: str) -> dict[str, bool]:
    ref = figures[f"{flavour}/4"]
    weights = cpu.final_state(root, f"{flavour}-4")
    out = {}
    for dp in (2, 1):
        other = cpu.final_state(root, f"{flavour}-{dp}")
        out[f"dp{dp} == dp4 (losses, norms, load)"] = figures[f"{flavour}/{dp}"] == ref
        out[f"dp{dp} == dp4 (weights, optimizer)"] = all(torch.equal(other[k], weights[k]) for k in weights)
        resumed = figures[f"{flavour}/4->{dp}"]
        out[f"resume 4->{dp} == dp4"] = all(row == ref[s] for s, row in resumed.items()) and len(resumed) == cpu.STEPS - cpu.RESUME_AT
    return out


def main() -> int:
    assert torch.cuda.is_available(), "a CUDA device is needed"
    out_path = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": cpu.STEPS}
    failed = False
    wanted = os.environ.get("FLAVOURS", ",".join(cpu.FLAVOURS)).split(",")
    for flavour in wanted:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "tokens").mkdir()
            make_corpus(root / "tokens")
            try:
                run_ranks(ranks, 4, str(root), str(root / "tokens"), [flavour], timeout=900)
            except Exception as e:  # noqa: BLE001 - reported per flavour
                results[flavour] = {"error": str(e).splitlines()[-1][:300]}
                print(f"{flavour}: could not run: {results[flavour]['error']}")
                failed = True
                continue
            figures = json.loads((root / "figures.json").read_text())
            checks = compare(root, figures, flavour)
            a, b = figures["control/4"], figures["control/1"]
            checks["control: default mode dp4 != dp1"] = any(a[s] != b[s] for s in a)
            results[flavour] = checks
            for name, ok in checks.items():
                print(f"{flavour:6s} {name:40s} {'equal' if ok and 'control' not in name else ('differs' if ok else 'FAILED')}")
            failed |= not all(checks.values())
    if out_path:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
