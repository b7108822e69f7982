"""train.deterministic on the GPU: are reruns bitwise identical, and what does the mode cost?

    python -m bench.determinism --layers 4 --accum 2 --steps 8

Every run is a fresh process with the library's own step (OLMoE-1B-7B width, bf16 weights,
fp32 masters, fused AdamW, clipping), random token ids, the same seed:

- one GPU, mode on and off: the same run twice on the same GPU (and once on the other GPU),
- mode on: a run SIGKILLed during step ``kill_at`` after checkpointing, then resumed,
- two GPUs, EP=2 over NCCL (``--ep``): the same run twice, mode on and off.

A run is summarised by its per-step losses and a fingerprint of every fp32 master weight,
AdamW moment and bf16 weight (weighted integer sums of the raw bits, computed on the device);
"bitwise equal" means all losses and the fingerprint are equal. Step time is the median of
the steps after warm-up (CUDA events); one step runs under torch.cuda.set_sync_debug_mode
("warn") and the host syncs it reports are recorded. ``--device cpu --preset tiny`` is a
smoke run of the same plumbing.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe.parallel.spawn import RankGroup, start_ranks

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ one run (a child process)


def _fingerprint(trainer) -> str:
    """sha256 over (sum of bits, position-weighted sum of bits) of every state tensor."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for name, master in trainer.opt.named_masters().items():
        tensors[f"master.{name}"] = master
    for name, state in trainer.opt.named_state().items():
        for k in ("exp_avg", "exp_avg_sq"):
            tensors[f"{k}.{name}"] = state[k]
    for name, param in trainer.model.named_parameters():
        tensors[f"param.{name}"] = param
    sums = []
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().view(-1)
        bits = t.view(torch.int32 if t.element_size() == 4 else torch.int16).to(torch.int64)
        w = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 1_000_003 + 1
        sums.append(torch.stack([bits.sum(), (bits * w).sum()]))
    values = torch.stack(sums).cpu().tolist()
    h = hashlib.sha256()
    for name, v in zip(sorted(tensors), values, strict=True):
        h.update(f"{name}:{v[0]}:{v[1]};".encode())
    return h.hexdigest()[:24]


def child(spec: dict[str, Any]) -> int:
    """One rank of one run: train, then write this rank's summary next to ``spec["out"]``."""
    from moe.parallel.env import shutdown_distributed
    from moe.train.trainer import Trainer

    trainer = Trainer(_child_config(spec, int(os.environ.get("WORLD_SIZE", "1"))))
    if spec.get("resume"):
        trainer.maybe_resume()
    times, sync_warnings = _train(trainer, spec)
    out = _child_summary(trainer, spec, times, sync_warnings)
    Path(spec["out"]).with_suffix(f".rank{trainer.env.rank}.json").write_text(json.dumps(out))
    shutdown_distributed()
    return 0


def _child_config(spec: dict[str, Any], world: int):
    from moe.config import ExperimentConfig

    model = {"preset": spec["preset"], "n_layers": spec["layers"], "max_seq_len": spec["seq"]}
    if spec["preset"] == "tiny":
        model["vocab_size"] = spec["vocab"]
    return ExperimentConfig.load(
        {
            "model": model,
            "data": {"paths": [spec["data"]], "seq_len": spec["seq"], "verify_checksums": False},
            "train": {
                "global_batch_size": spec["micro"] * spec["accum"] * world,
                "micro_batch_size": spec["micro"],
                "max_steps": spec["steps"],
                "log_every": 10**6,
                "device": spec["device"],
                "deterministic": spec["deterministic"],
            },
            "schedule": {"warmup_steps": 1},
            "checkpoint": {"dir": spec["ckpt"]},
            "parallel": {"ep": spec["ep"]},
            "precision": {"recipe": "bf16" if spec["device"] == "cuda" else "fp32"},
        }
    )


def _train(trainer, spec: dict[str, Any]) -> tuple[list[float], list[str]]:
    """The run's steps (killed at ``kill_at``, checkpointed at ``checkpoint_at``): the step times
    after warm-up and the host syncs reported in the first step after it."""
    cuda = spec["device"] == "cuda"
    times: list[float] = []
    sync_warnings: list[str] = []
    while trainer.step < spec["steps"]:
        if spec.get("kill_at") == trainer.step + 1:
            trainer.train_step()  # queued on the device; killed while it runs
            os.kill(os.getpid(), signal.SIGKILL)
        sync_step = cuda and trainer.step == spec["warmup"] and not spec.get("resume")
        elapsed, caught = _timed_step(trainer, cuda, sync_step)
        if sync_step:
            sync_warnings = caught
        trainer.step += 1
        if trainer.step > spec["warmup"] and not sync_step:
            times.append(elapsed)
        if spec.get("checkpoint_at") == trainer.step:
            trainer.save_checkpoint()
    return times, sync_warnings


def _timed_step(trainer, cuda: bool, sync_step: bool) -> tuple[float, list[str]]:
    """One step's seconds (CUDA events on the GPU) and, on the sync step (under
    set_sync_debug_mode("warn")), the host syncs it reported."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    caught_messages: list[str] = []
    if sync_step:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train_step()
        torch.cuda.set_sync_debug_mode(0)
        caught_messages = sorted({str(w.message).splitlines()[0][:200] for w in caught})
    else:
        trainer.train_step()
    if cuda:
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3, caught_messages
    return time.perf_counter() - t0, caught_messages


def _child_summary(trainer, spec: dict[str, Any], times: list[float], sync_warnings: list[str]) -> dict[str, Any]:
    import torch

    cuda = spec["device"] == "cuda"
    losses = {s: v for s, v in zip([s for s, _ in trainer._pending], torch.stack([v for _, v in trainer._pending]).tolist(), strict=True)}
    return {
        "rank": trainer.env.rank,
        "losses": losses,
        "fingerprint": _fingerprint(trainer),
        "step_times_s": times,
        "step_s": statistics.median(times) if times else None,
        "host_sync_warnings": sync_warnings,
        "determinism": trainer.determinism.to_meta(),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "start_step": trainer.start_step,
    }


# ------------------------------------------------------------------ the driver


def launch(spec: dict[str, Any], gpus: list[int], logs: Path) -> RankGroup:
    """Start one run (len(gpus) ranks) in fresh processes; returns its ranks."""
    spec_path = Path(spec["out"]).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO"):
        env.pop(k, None)  # each run sets (or not) its own mode
    if spec["device"] == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    argv = [sys.executable, "-m", "bench.determinism", "--child", str(spec_path)]
    return start_ranks(argv, len(gpus), env=env, cwd=ROOT, logs=[logs / f"{spec['name']}.rank{rank}.log" for rank in range(len(gpus))])


def collect(spec: dict[str, Any], ranks: RankGroup, logs: Path, deadline: float) -> dict[str, Any]:
    # every rank is waited for, a failed one's peers too (as a run with no such helper did)
    codes = ranks.wait(timeout=max(1.0, deadline + 60 - time.perf_counter()), stop_on_failure=False)
    summaries = []
    for rank in range(ranks.world):
        path = Path(spec["out"]).with_suffix(f".rank{rank}.json")
        summaries.append(json.loads(path.read_text()) if path.is_file() else None)
    result: dict[str, Any] = {
        "name": spec["name"],
        "exit_codes": codes,
        "deterministic": spec["deterministic"],
        "gpus": spec.get("gpus"),
        "ep": spec["ep"],
    }
    if all(r is not None for r in summaries):
        r0 = summaries[0]
        result.update(
            {
                "losses": r0["losses"],
                "fingerprint": "/".join(r["fingerprint"] for r in summaries),
                "step_s": r0["step_s"],
                "step_times_s": r0["step_times_s"],
                "peak_mem_gib": r0["peak_mem_gib"],
                "host_sync_warnings": r0["host_sync_warnings"],
                "settings": r0["determinism"]["settings"],
                "start_step": r0["start_step"],
            }
        )
    else:
        tail = (logs / f"{spec['name']}.rank0.log").read_text().splitlines()[-15:] if (logs / f"{spec['name']}.rank0.log").is_file() else []
        result["log_tail"] = tail
    return result


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Bitwise comparison of b against a over the steps b ran."""
    if "losses" not in a or "losses" not in b:
        return {"a": a["name"], "b": b["name"], "bitwise_equal": None, "note": "a run failed"}
    steps = sorted(b["losses"], key=int)
    diffs = {s: abs(a["losses"][s] - b["losses"][s]) / max(abs(a["losses"][s]), 1e-30) for s in steps}
    first = next((s for s in steps if diffs[s] != 0), None)
    same_w = a["fingerprint"] == b["fingerprint"]
    return {
        "a": a["name"],
        "b": b["name"],
        "steps": [int(s) for s in steps],
        "losses_equal": first is None,
        "first_differing_step": int(first) if first else None,
        "max_rel_loss_diff": max(diffs.values()),
        "weights_equal": same_w,
        "bitwise_equal": first is None and same_w,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--preset", default="olmoe-1b-7b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=8, help="steps per run (the kill/resume run checkpoints at half)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step time")
    p.add_argument("--ep", action="store_true", help="also EP=2 on two GPUs, twice per mode (part 'ep')")
    p.add_argument("--parts", default="pairs,resume,ep", help="which comparisons: pairs (reruns, cost), resume, ep")
    p.add_argument("--time-limit", type=float, default=1e9, help="start no new wave after this many seconds")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        return child(json.loads(a.child.read_text()))
    gpus = 1
    if a.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus < 1:
            print("bench.determinism needs a CUDA GPU (or --device cpu)", file=sys.stderr)
            return 2
    results, t_start = run(a, gpus)
    return report(a, results, t_start, final=True)


def run_spec(a: argparse.Namespace, vocab: int, tmp: Path, name: str, det: bool, gpu_list: list[int], **extra: Any) -> dict[str, Any]:
    """What one run's ranks read (``child``): the shape, mode, GPUs, data and where to write."""
    return {
        "name": name,
        "deterministic": det,
        "device": a.device,
        "preset": a.preset,
        "vocab": vocab,
        "layers": a.layers,
        "seq": a.seq,
        "micro": a.micro,
        "accum": a.accum,
        "steps": a.steps,
        "warmup": a.warmup,
        "data": str(tmp / "tokens"),
        "ckpt": str(tmp / f"ck-{name}"),
        "out": str(tmp / name),
        "ep": 2 if len(gpu_list) > 1 else 1,
        "gpus": gpu_list,
        **extra,
    }


def plan_waves(a: argparse.Namespace, gpus: int, spec: Callable[..., dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Waves of runs started together. Timing comes from the runs alone on their GPU (on_a,
    off_a on GPU 0; on_c, off_c on GPU 1); the rest only check equality, and some share a GPU
    with another run (concurrency must not change the bits in the mode either)."""
    half = a.steps // 2
    g1 = 1 if gpus > 1 else 0
    parts = set(a.parts.split(","))
    waves: list[list[dict[str, Any]]] = []
    if "pairs" in parts:
        waves += [[spec("on_a", True, [0]), spec("on_c", True, [g1])], [spec("off_a", False, [0]), spec("off_c", False, [g1])]]
    third = [spec("on_b", True, [0]), spec("off_b", False, [0])] if "pairs" in parts else []
    if "resume" in parts:
        killed = spec("on_killed", True, [g1], checkpoint_at=half, kill_at=half + 1)
        third += [killed] if "pairs" in parts else [spec("on_c", True, [g1]), killed]
        waves += [third, [spec("on_resumed", True, [g1], resume=True, ckpt=killed["ckpt"])]]
    elif third:
        waves.append(third)
    if "ep" in parts and a.ep and (gpus >= 2 or a.device == "cpu"):
        waves += [[spec(f"ep2_{m}_{i}", m == "on", [0, 1]) for i in "ab"] for m in ("on", "off")]
    if a.device == "cpu":  # one at a time on the CPU
        waves = [[s] for w in waves for s in w]
    return waves


def run(a: argparse.Namespace, gpus: int) -> tuple[dict[str, dict[str, Any]], float]:
    """Every wave's runs (the JSON rewritten after each wave); the results by run name and the
    start time."""
    from bench.model import make_data

    vocab = 256 if a.preset == "tiny" else 50304
    shm = Path("/dev/shm")
    use_shm = shm.is_dir() and shutil.disk_usage(shm).free > 64 * 2**30
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir=shm if use_shm else None) as tmp:
        tmp = Path(tmp)
        data, logs = tmp / "tokens", tmp / "logs"
        data.mkdir()
        logs.mkdir()
        world_max = 2 if a.ep else 1
        make_data(data, (a.seq + 1) * a.micro * a.accum * world_max * (a.steps + 2), vocab)
        waves = plan_waves(a, gpus, functools.partial(run_spec, a, vocab, tmp))
        t_start = time.perf_counter()
        for wave in waves:
            running = [(s, launch(s, s["gpus"], logs)) for s in wave]
            for s, ranks in running:
                results[s["name"]] = collect(s, ranks, logs, deadline=t_start + a.time_limit)
                _print_run(s["name"], results[s["name"]], t_start)
            if time.perf_counter() - t_start > a.time_limit:
                print(f"time limit {a.time_limit}s reached: skipping the remaining runs", flush=True)
                break
            report(a, results, t_start, final=False)
    return results, t_start


def _print_run(name: str, r: dict[str, Any], t_start: float) -> None:
    print(
        f"[{time.perf_counter() - t_start:6.1f}s] {name}: exit {r['exit_codes']} step_s={r.get('step_s')} fingerprint={r.get('fingerprint')}",
        flush=True,
    )
    if "log_tail" in r and name != "on_killed":
        print("\n".join(r["log_tail"]), flush=True)


PAIRS = [
    ("on_a", "on_b", "mode on, GPU 0, two runs"),
    ("on_a", "on_c", "mode on, GPU 0 vs GPU 1"),
    ("on_c", "on_resumed", "mode on, GPU 1, SIGKILLed and resumed vs uninterrupted"),
    ("off_a", "off_b", "mode off, GPU 0, two runs"),
    ("off_a", "off_c", "mode off, GPU 0 vs GPU 1"),
    ("ep2_on_a", "ep2_on_b", "EP=2 on 2 GPUs, mode on, two runs"),
    ("ep2_off_a", "ep2_off_b", "EP=2 on 2 GPUs, mode off, two runs"),
]


def report(a: argparse.Namespace, results: dict[str, dict[str, Any]], t_start: float, final: bool) -> int:
    """Print the tables (final) and (re)write the JSON result."""
    import numpy as np

    from bench.common import environment, print_table, write_result

    half = a.steps // 2
    rows = []
    for x, y, what in PAIRS:
        if x in results and y in results:
            rows.append({"comparison": what, **compare(results[x], results[y])})
    costs = []
    for on, off, what in (("on_a", "off_a", "1 GPU (GPU 0)"), ("on_c", "off_c", "1 GPU (GPU 1)")):
        if results.get(on, {}).get("step_s") and results.get(off, {}).get("step_s"):
            costs.append(
                {
                    "layout": what,
                    "step_s_off": results[off]["step_s"],
                    "step_s_on": results[on]["step_s"],
                    "cost": results[on]["step_s"] / results[off]["step_s"] - 1,
                }
            )
    killed = results.get("on_killed", {})
    tokens = a.micro * a.accum * a.seq
    payload = {
        "benchmark": "determinism",
        "environment": environment(),
        "config": {
            **{k: v for k, v in vars(a).items() if k not in ("child", "result_path")},
            "tokens_per_step_per_gpu": tokens,
            "checkpoint_and_kill": [half, half + 1],
        },
        "comparisons": rows,
        "costs": costs,
        "killed_exit_codes": killed.get("exit_codes"),
        "runs": results,
        "wall_s": time.perf_counter() - t_start,
        "complete": final,
        "numpy": np.__version__,
    }
    if not a.no_save:
        if getattr(a, "result_path", None) is None:
            a.result_path = write_result("determinism", payload)
        else:
            a.result_path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    if final:
        if rows:
            print_table(rows, ["comparison", "bitwise_equal", "losses_equal", "weights_equal", "first_differing_step", "max_rel_loss_diff"])
        if costs:
            print()
            print_table(costs, ["layout", "step_s_off", "step_s_on", "cost"])
        print(f"killed run exit codes: {killed.get('exit_codes')} (-9 = SIGKILL)")
        for name in ("on_a", "off_a", "ep2_on_a"):
            if name in results:
                print(f"host syncs in one step, {name}: {results[name].get('host_sync_warnings')}")
        if not a.no_save:
            print(f"wrote {a.result_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
