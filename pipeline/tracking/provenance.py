"""What a run is tagged with: git, DVC, the environment and the container image, MLflow's own
source tags, and parameters made storable (flattened, redacted, capped)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moe.digest import sha256_file
from moe.reader import MIB, AnyOf, FileFormatError, List, Map, Nullable, Plain, Spec, Str, read_bytes, read_json, read_yaml
from pipeline.redact import redact, without_userinfo

log = logging.getLogger("pipeline.tracking")

MAX_PARAM_CHARS = 6000


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_info() -> dict[str, str]:
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"git.commit": "unknown"}
    status = _git("status", "--porcelain", "--untracked-files=no") or ""
    return {"git.commit": commit, "git.dirty": str(bool(status)).lower(), "git.branch": _git("rev-parse", "--abbrev-ref", "HEAD") or ""}


def pipeline_key(params_path: Path) -> str:
    if os.environ.get("MOE_PIPELINE_KEY"):
        return os.environ["MOE_PIPELINE_KEY"]
    h = hashlib.sha256(params_path.read_bytes() if params_path.is_file() else b"")
    h.update((git_info().get("git.commit") or "").encode())
    return h.hexdigest()[:16]


# DVC's own files, as far as the tags read them (DVC writes and checks the rest, free-form here):
# each stage's outputs with their md5 in dvc.lock, each stage's deps in dvc.yaml.
_DVC_PATH = Str(4096)
_DVC_OUT = Map(required={"path": _DVC_PATH}, optional={"md5": Str(64, r"[0-9a-f]{32}(\.dir)?")}, other=Plain())
_DVC_LOCK_STAGE = Map(optional={"outs": Nullable(List(_DVC_OUT))}, other=Plain())
_DVC_YAML_STAGE = Map(optional={"deps": Nullable(List(AnyOf((_DVC_PATH, Map(other=Plain())), "a path")))}, other=Plain())
DVC_LOCK_SCHEMA = Nullable(Map(optional={"stages": Nullable(Map(other=_DVC_LOCK_STAGE, max_keys=10_000))}, other=Plain()))
DVC_YAML_SCHEMA = Nullable(Map(optional={"stages": Nullable(Map(other=_DVC_YAML_STAGE, max_keys=10_000))}, other=Plain()))
MAX_DVC_FILE_BYTES = 16 * MIB


def _yaml(path: Path, schema: Spec) -> dict:
    """DVC's file at ``path`` checked against ``schema``; {} where there is none, or it is not
    one (the tags are a courtesy: a missing one never fails a stage)."""
    try:
        return read_yaml(path, schema, MAX_DVC_FILE_BYTES) or {}
    except FileFormatError:
        return {}


def dvc_out_hashes(lock_path: Path = Path("dvc.lock")) -> dict[str, str]:
    """path -> md5 of every stage output recorded in dvc.lock."""
    hashes = {}
    for stage in (_yaml(lock_path, DVC_LOCK_SCHEMA).get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if "md5" in out:
                hashes[out["path"]] = out["md5"]
    return hashes


def dvc_dep_tags(stage: str, dvc_yaml: Path = Path("dvc.yaml"), lock_path: Path = Path("dvc.lock")) -> dict[str, str]:
    """``dvc.dep.<path>`` -> md5 for this stage's inputs that earlier stages produced.

    DVC writes a stage's entry in dvc.lock as soon as it finishes, so when a stage starts, the
    hashes of the data it reads are already there."""
    deps = ((_yaml(dvc_yaml, DVC_YAML_SCHEMA).get("stages") or {}).get(stage) or {}).get("deps") or []
    outs = dvc_out_hashes(lock_path)
    return {f"dvc.dep.{d}": outs[d] for d in deps if isinstance(d, str) and d in outs}


# The image's inventory, as containers/inventory.py writes it at build time (image_digest: a
# digest recorded into it after the build, which environment_tags prefers to none).
_VERSION = Nullable(Str(128))
INVENTORY_SCHEMA = Map(
    optional={
        "base_image": Str(1024),
        "base_image_digest": Nullable(Str(128, r"[A-Za-z0-9_+.\-]+:[0-9a-fA-F]{32,128}")),
        "image_digest": Nullable(Str(128, r"[A-Za-z0-9_+.\-]+:[0-9a-fA-F]{32,128}")),
        "lock": Str(4096),
        "lock_sha256": Nullable(Str(64, r"[0-9a-f]{64}")),
        **dict.fromkeys(("python", "torch", "triton", "nvshmem", "cuda", "nccl"), _VERSION),
        "pip_freeze": List(Str(4096), max_len=100_000),
    }
)
MAX_INVENTORY_BYTES = 16 * MIB


def read_inventory() -> dict[str, Any]:
    """The container image's inventory ($MOE_IMAGE_INVENTORY), or {} outside the image (or where
    the file is not one: its tags are a courtesy, never a failed stage)."""
    path = Path(os.environ.get("MOE_IMAGE_INVENTORY", "/opt/moe/inventory.json"))
    if not os.path.lexists(path):
        return {}
    try:
        return read_json(path, INVENTORY_SCHEMA, MAX_INVENTORY_BYTES)
    except FileFormatError as exc:
        log.warning("image inventory: %s; its tags are left out", exc)
        return {}


def inventory_tags() -> dict[str, str]:
    """Tags from the container image's inventory file, when running inside the image."""
    inv = read_inventory()
    if not inv:
        return {}
    tags = {
        f"image.{k}": str(inv[k])
        for k in ("base_image", "base_image_digest", "python", "torch", "cuda", "nccl", "nvshmem", "lock_sha256")
        if inv.get(k)
    }
    if os.environ.get("MOE_IMAGE_DIGEST"):
        tags["container.image_digest"] = os.environ["MOE_IMAGE_DIGEST"]
    return tags


def environment_tags() -> dict[str, str]:
    tags = {"host": socket.gethostname(), "python": platform.python_version()}
    try:
        import torch

        tags["torch"] = torch.__version__
        tags["cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():
            tags["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    inv = read_inventory()
    digest = os.environ.get("MOE_IMAGE_DIGEST") or inv.get("image_digest")
    for k in ("cuda", "nccl", "nvshmem"):
        if inv.get(k):
            tags[f"image.{k}"] = str(inv[k])
    if digest:
        tags["container.image_digest"] = digest
    for lock in ("requirements/cpu.lock", "requirements/gpu.lock"):
        if Path(lock).is_file():
            tags[f"lock.{Path(lock).name}"] = sha256_file(lock)[:16]
    return tags


def standard_tags(stage: str) -> dict[str, str]:
    """MLflow's own source, git and user tags (what its UI shows in the run's header)."""
    import getpass

    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": f"moe {stage}"}
    with contextlib.suppress(KeyError, OSError):
        tags["mlflow.user"] = getpass.getuser()
    info = git_info()
    if info.get("git.commit", "unknown") != "unknown":
        tags["mlflow.source.git.commit"] = info["git.commit"]
        if info.get("git.branch"):
            tags["mlflow.source.git.branch"] = info["git.branch"]
        remote = _git("remote", "get-url", "origin")
        if remote:  # without its user (which may be a token), password and credential parameters
            tags["mlflow.source.git.repoURL"] = without_userinfo(remote)
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp_name"] = os.environ["DVC_EXP_NAME"]
    if os.environ.get("DVC_EXP_BASELINE_REV"):
        tags["dvc.exp_baseline_rev"] = os.environ["DVC_EXP_BASELINE_REV"]
    return tags


def run_name(stage: str, suffix: str | None = None) -> str:
    """``stage`` (or ``stage-suffix``), followed by the DVC experiment's name when DVC runs one."""
    name = f"{stage}-{suffix}" if suffix else stage
    exp = os.environ.get("DVC_EXP_NAME")
    return f"{name} ({exp})" if exp else name


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def param_value(value: Any) -> str:
    text = redact(value if isinstance(value, str) else json.dumps(value))
    if len(text) > MAX_PARAM_CHARS:
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        suffix = f"...[truncated; sha256 {digest}; full value in params.yaml artifact]"
        text = text[: MAX_PARAM_CHARS - len(suffix)] + suffix
    return text


MAX_ARTIFACT_BYTES = 1024 * MIB  # a text artifact masked in memory (a long run's metrics.jsonl: some 100 MB)


def redacted_copy(path: Path) -> Path:
    """``path`` itself, or a copy under a temporary directory with every URI password masked."""
    import tempfile

    text = read_bytes(path, MAX_ARTIFACT_BYTES).decode(errors="replace")  # (FileFormatError: too large, not a file)
    masked = redact(text)
    if masked == text:
        return path
    out = Path(tempfile.mkdtemp(prefix="moe-redacted-")) / path.name
    out.write_text(masked)
    return out
