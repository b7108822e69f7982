"""Write the image inventory (JSON on stdout): what was installed, from what, at which versions.

Training records it as MLflow tags (pipeline.tracking.environment_tags reads
$MOE_IMAGE_INVENTORY)."""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import subprocess
import sys
from importlib import metadata


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--base-image", default="")
    p.add_argument("--lock", default="")
    a = p.parse_args()
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout.splitlines()
    inv = {
        "base_image": a.base_image,
        "base_image_digest": a.base_image.split("@", 1)[1] if "@" in a.base_image else None,
        "lock": a.lock,
        "lock_sha256": hashlib.sha256(open(a.lock, "rb").read()).hexdigest() if a.lock else None,
        "python": platform.python_version(),
        "torch": version("torch"),
        "triton": version("triton"),
        "nvshmem": version("nvidia-nvshmem-cu13") or version("nvidia-nvshmem-cu12"),
        "pip_freeze": freeze,
    }
    try:
        import torch

        inv["cuda"] = torch.version.cuda
        inv["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() or torch.version.cuda else None
    except Exception:  # noqa: BLE001 - the inventory must not fail the build
        inv.setdefault("cuda", None)
        inv.setdefault("nccl", None)
    json.dump(inv, sys.stdout, indent=2, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
