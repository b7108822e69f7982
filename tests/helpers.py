"""Shared test helpers: small token corpora and configs, and Triton interpreter runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from moe.config import ExperimentConfig
from moe.data import write_token_file


def make_corpus(
    directory: Path, *, files: int = 2, tokens: int = 4000, vocab: int = 256, seed: int = 0, tokenizer_hash: str | None = "tok-hash"
) -> list[Path]:
    """Token files of a learnable synthetic language: noisy repeated phrases separated by EOS=0."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, vocab, size=rng.integers(4, 12)) for _ in range(16)]
    paths = []
    for f in range(files):
        out: list[int] = []
        while len(out) < tokens:
            for _ in range(rng.integers(3, 8)):
                out.extend(phrases[rng.integers(len(phrases))].tolist())
            out.append(0)
        path = directory / f"part-{f:05d}.npy"
        write_token_file(path, np.array(out[:tokens]), vocab_size=vocab, eos_id=0, tokenizer_hash=tokenizer_hash)
        paths.append(path)
    return paths


def make_markov_corpus(directory: Path, *, tokens: int = 40_000, vocab: int = 256, branches: int = 16, seed: int = 0) -> Path:
    """One token file of a bigram language whose entropy (about 2 nats per token with 16
    branches) keeps a tiny model's loss far from zero: a regime where a relative loss bar
    means what it does on real text."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(1, vocab, size=(vocab, branches))
    weights = rng.dirichlet(np.ones(branches), size=vocab)
    out = np.empty(tokens, dtype=np.int64)
    out[0] = 1
    for i in range(1, tokens):
        prev = out[i - 1]
        out[i] = successors[prev, rng.choice(branches, p=weights[prev])]
    path = directory / "part-00000.npy"
    write_token_file(path, out, vocab_size=vocab, eos_id=0, tokenizer_hash="tok-hash")
    return path


class TagSink:
    """A trainer sink that keeps the logged rows and the tags (for the alarm and health tests)."""

    def __init__(self):
        self.rows, self.tags = [], {}

    def log(self, step, metrics):
        self.rows.append((step, metrics))

    def set_tags(self, tags):
        self.tags.update(tags)

    def close(self, summary):
        pass


def steps_without_host_sync(trainer: Any, steps: int) -> None:
    """``steps`` training steps with every host sync an error (CUDA's sync debug mode)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            trainer.train_step()
            trainer.step += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)


def tiny_config(data_dir: Path, ckpt_dir: Path, **sections: Any) -> ExperimentConfig:
    base: dict[str, Any] = {
        "model": {"preset": "tiny", "vocab_size": 256},
        "data": {"paths": [str(data_dir)], "seq_len": 32},
        "train": {"max_steps": 6, "log_every": 1, "global_batch_size": 4, "micro_batch_size": 2},
        "schedule": {"warmup_steps": 2},
        "checkpoint": {"dir": str(ckpt_dir)},
    }
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return ExperimentConfig.load(base)


REPO = Path(__file__).resolve().parents[1]


class Planted:
    """Pickles to a call of os.system that creates ``marker``: what an attacker would plant."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_pickle(path: Path, marker: Path) -> None:
    """A torch.save file for .pt (what torch.load reads), a bare pickle for DCP's .metadata."""
    import pickle

    if path.suffix == ".pt":
        import torch

        torch.save(Planted(marker), path)
    else:
        path.write_bytes(pickle.dumps(Planted(marker)))


def reseal(step_dir: Path) -> None:
    """Recompute meta.json's checksums, its own included, as an attacker who edits a checkpoint would."""
    import hashlib
    import json

    from moe.train.checkpoint import meta_digest

    meta = json.loads((step_dir / "meta.json").read_text())
    if "files" in meta:
        meta["files"] = {name: hashlib.sha256((step_dir / name).read_bytes()).hexdigest() for name in meta["files"]}
    meta["meta_sha256"] = meta_digest(meta)
    (step_dir / "meta.json").write_text(json.dumps(meta))


def run_under_triton_interpreter(args: list[str], expect: str, timeout: int = 600) -> None:
    """Run ``python *args`` with TRITON_INTERPRET=1 (a fresh process: the interpreter must be
    chosen before triton is imported) and assert it exits 0 and prints ``expect``."""
    import pytest

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout, r.stdout + r.stderr


SKIP_IN_COPIES = ("data/", "runs/", "metrics/", "plots/")


def committed_params() -> str:
    """The shipped params.yaml (HEAD's), never the working one: the README's `dvc exp run`
    lines change the working copy (DVC applies an experiment's params to the workspace)."""
    r = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=REPO, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else (REPO / "params.yaml").read_text()


def copy_checkout(dest: Path, skip_prefixes: tuple[str, ...] = (), skip_files: tuple[str, ...] = ()) -> Path:
    """Copy this checkout's tracked and untracked-but-not-ignored files into ``dest`` (a project
    as a user would have it), without pipeline outputs (data/, runs/, metrics/, plots/, dvc.lock)
    and whatever else the caller names."""
    import shutil

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    skip = SKIP_IN_COPIES + tuple(skip_prefixes)
    for f in files:
        src = REPO / f
        if src.is_file() and not f.startswith(skip) and f not in ("dvc.lock", *skip_files):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    if (dest / "params.yaml").is_file():
        (dest / "params.yaml").write_text(committed_params())
    return dest


def plant_bytes_entry(step_dir: Path, marker: Path) -> None:
    """What the audit planted: a `.metadata` entry of kind BytesStorageMetadata pointing at a
    torch.save'd payload appended to a shard (DCP's default planner would torch.load it with
    weights_only=False), every checksum resealed."""
    import io
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    buf = io.BytesIO()
    torch.save(Planted(marker), buf)
    shard = sorted(step_dir.glob("*.distcp"))[0]
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    md = pickle.loads((step_dir / ".metadata").read_bytes())
    key = next(k for k in md.state_dict_metadata if k.startswith("model."))
    md.state_dict_metadata[key] = BytesStorageMetadata()
    template = next(iter(md.storage_data.values()))
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
    md.storage_data[MetadataIndex(key)] = type(template)(relative_path=shard.name, offset=offset, length=len(buf.getvalue()))
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))
    reseal(step_dir)


def read_checkpoint_tree(step_dir: Path) -> dict:
    """Every tensor of a checkpoint, whole (whatever layout wrote it), as the trainer's tree:
    {"model": {name: t}, "optim": {name: {field: t}}}."""
    import torch
    import torch.distributed.checkpoint as dcp

    from moe.train.safe_dcp import SafeFileSystemReader, read_metadata

    md = read_metadata(step_dir / ".metadata")
    flat = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    tree: dict = {}
    for k, t in flat.items():
        section, rest = k.split(".", 1)
        if section == "optim":
            name, field = rest.rsplit(".", 1)
            tree.setdefault("optim", {}).setdefault(name, {})[field] = t
        else:
            tree.setdefault(section, {})[rest] = t
    dcp.load(tree, storage_reader=SafeFileSystemReader(step_dir), no_dist=True)
    return tree


def read_checkpoint(step_dir: Path) -> dict:
    """Every tensor of a checkpoint, whole, by its flat key (``model.<name>``, ``optim.<name>.<field>``)."""
    tree = read_checkpoint_tree(step_dir)
    flat = {f"model.{k}": t for k, t in tree.get("model", {}).items()}
    flat.update({f"optim.{name}.{field}": t for name, fields in tree.get("optim", {}).items() for field, t in fields.items()})
    return flat


def rewrite_checkpoint(step_dir: Path, change) -> None:
    """Load every tensor of a checkpoint, apply ``change(tensors)`` and save it back in place
    with valid checksums (a forger's or a bug's checkpoint: internally consistent)."""
    import json
    import shutil

    from moe.train.checkpoint import CheckpointManager, load_plain

    tree = read_checkpoint_tree(step_dir)
    change(tree)
    meta = json.loads((step_dir / "meta.json").read_text())
    rng = load_plain(step_dir / "rng-rank00000.pt")
    root, step = step_dir.parent, meta["step"]
    shutil.rmtree(step_dir)
    body = {k: v for k, v in meta.items() if k not in ("files", "meta_sha256", "step", "world_size")}
    CheckpointManager(root, keep_last=100).save(step, tree, body, rng)


def moe(*args, env=None, timeout=600):
    """`moe ARGS` as a subprocess with this interpreter (output captured)."""
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout
    )


def sh(*cmd, cwd, env, check=True):
    """Run a command; on failure, an AssertionError with the end of its output."""
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def need_slurm(what: str) -> None:
    """Skip without Slurm, but fail in CI (MOE_REQUIRE_SLURM=1), which must run the Slurm suites."""
    import pytest

    if os.environ.get("MOE_REQUIRE_SLURM"):
        pytest.fail(f"{what} (MOE_REQUIRE_SLURM=1)")
    pytest.skip(what)


def slurm_jobs_under(root: Path) -> list[str]:
    """The queued, running or completing Slurm jobs (array jobs as one id) whose working directory lies under root."""
    if not shutil.which("squeue"):
        return []
    r = subprocess.run(["squeue", "-h", "-o", "%A|%Z"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return []
    root = Path(root).resolve()
    jobs = []
    for line in r.stdout.splitlines():
        job, _, workdir = line.partition("|")
        if workdir and Path(workdir).resolve().is_relative_to(root) and job not in jobs:
            jobs.append(job)
    return jobs


def cancel_slurm_jobs_under(root: Path, timeout: float = 180.0) -> list[str]:
    """Cancel the jobs a test session left under its tmp root and wait until they have left the nodes.

    A job outliving its module (a timed-out test's, a requeued one) held a node for the next module, whose
    two-node job then waited past its timeout (CI at 6254e23). Jobs started elsewhere, a user's own, are
    never touched: only those whose working directory is this session's."""
    jobs = slurm_jobs_under(root)
    if jobs:
        subprocess.run(["scancel", *jobs], capture_output=True, text=True, timeout=60)
        deadline = time.time() + timeout
        while slurm_jobs_under(root) and time.time() < deadline:
            time.sleep(1)
        left = slurm_jobs_under(root)
        if left:
            queue = subprocess.run(["squeue"], capture_output=True, text=True, timeout=60).stdout
            raise AssertionError(f"Slurm jobs {left} of this test session still queued {timeout:.0f} s after scancel:\n{queue}")
    return jobs
