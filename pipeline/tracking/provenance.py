"""What a run is tagged with: git, DVC, the environment and the container image, MLflow's own
source tags, and parameters made storable (flattened, redacted, capped)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from pipeline.redact import redact, without_userinfo

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


def _yaml(path: Path) -> dict:
    try:
        return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    except yaml.YAMLError:
        return {}


def dvc_out_hashes(lock_path: Path = Path("dvc.lock")) -> dict[str, str]:
    """path -> md5 of every stage output recorded in dvc.lock."""
    hashes = {}
    for stage in (_yaml(lock_path).get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if "md5" in out:
                hashes[out["path"]] = out["md5"]
    return hashes


def dvc_dep_tags(stage: str, dvc_yaml: Path = Path("dvc.yaml"), lock_path: Path = Path("dvc.lock")) -> dict[str, str]:
    """``dvc.dep.<path>`` -> md5 for this stage's inputs that earlier stages produced.

    DVC writes a stage's entry in dvc.lock as soon as it finishes, so when a stage starts, the
    hashes of the data it reads are already there."""
    deps = ((_yaml(dvc_yaml).get("stages") or {}).get(stage) or {}).get("deps") or []
    outs = dvc_out_hashes(lock_path)
    return {f"dvc.dep.{d}": outs[d] for d in deps if isinstance(d, str) and d in outs}


def inventory_tags() -> dict[str, str]:
    """Tags from the container image's inventory file, when running inside the image."""
    path = Path(os.environ.get("MOE_IMAGE_INVENTORY", "/opt/moe/inventory.json"))
    if not path.is_file():
        return {}
    try:
        inv = json.loads(path.read_text())
    except ValueError:
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
    digest = os.environ.get("MOE_IMAGE_DIGEST")
    inventory = Path(os.environ.get("MOE_IMAGE_INVENTORY", "/opt/moe/inventory.json"))
    if inventory.is_file():
        try:
            inv = json.loads(inventory.read_text())
            digest = digest or inv.get("image_digest")
            for k in ("cuda", "nccl", "nvshmem"):
                if inv.get(k):
                    tags[f"image.{k}"] = str(inv[k])
        except ValueError:
            pass
    if digest:
        tags["container.image_digest"] = digest
    for lock in ("requirements/cpu.lock", "requirements/gpu.lock"):
        if Path(lock).is_file():
            tags[f"lock.{Path(lock).name}"] = hashlib.sha256(Path(lock).read_bytes()).hexdigest()[:16]
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


def redacted_copy(path: Path) -> Path:
    """``path`` itself, or a copy under a temporary directory with every URI password masked."""
    import tempfile

    text = path.read_text(errors="replace")
    masked = redact(text)
    if masked == text:
        return path
    out = Path(tempfile.mkdtemp(prefix="moe-redacted-")) / path.name
    out.write_text(masked)
    return out
