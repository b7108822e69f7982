"""The real image, built without a registry or Docker engine, running a Slurm training job.

debootstrap makes a Debian root filesystem, Charliecloud imports it as the base, `make
container` builds containers/Dockerfile on it with the CPU lock, and `moe submit` with
container.runtime=charliecloud trains inside it on the local Slurm cluster. CI sets
MOE_REQUIRE_CONTAINER=1, so none of this skips there."""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.containers import image_build
from tests.workspace import REPO

pytestmark = pytest.mark.slow


def _need(what):
    if os.environ.get("MOE_REQUIRE_CONTAINER"):
        pytest.fail(f"{what} (MOE_REQUIRE_CONTAINER=1)")
    pytest.skip(what)


def sh(*cmd, timeout=1200, **kw):
    env = {**os.environ, "USER": os.environ.get("USER", "root")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="session")
def cpu_image(request):
    """The image the session started building in the background (tests/conftest.py), else built here."""
    why = image_build.missing()
    if why:
        _need(why)
    result = image_build.background_result(request.config)
    if result is None:
        try:
            built = image_build.build()
        except RuntimeError as e:
            pytest.fail(str(e))
    else:
        t0 = time.time()
        while not result.exists() and time.time() - t0 < 2400:
            time.sleep(1)
        assert result.exists(), f"the background image build wrote no result in 2400 s ({result})"
        built = json.loads(result.read_text())
        assert built.pop("ok"), f"the background image build failed: {built['error']}"
    print(f"image build (debootstrap + import + build + export): {built['build_s']:.0f} s")
    return {"dir": Path(built["dir"]), "build_s": built["build_s"], "log": built["log"]}


def test_image_holds_the_pinned_environment(cpu_image):
    inv = json.loads((cpu_image["dir"] / "opt/moe/inventory.json").read_text())
    assert inv["torch"] == "2.13.0+cpu"
    assert inv["lock"] == "requirements/cpu.lock"
    assert inv["lock_sha256"]
    assert any(line.startswith("mlflow==") for line in inv["pip_freeze"])
    r = sh(
        "ch-run",
        "--set-env",
        str(cpu_image["dir"]),
        "--",
        "sh",
        "-c",
        "command -v python3; command -v moe; python3 -c 'import torch, moe; print(torch.__version__)'",
    )
    assert r.stdout.splitlines()[:2] == ["/opt/moe/venv/bin/python3", "/opt/moe/venv/bin/moe"]


def test_slurm_job_trains_inside_the_image(cpu_image, workspace):
    from tests.helpers import moe

    r = subprocess.run(["bash", str(REPO / "slurm/local/start.sh")], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        _need(f"no Slurm cluster: {r.stderr[-300:]}")
    from pipeline.containers import directory_image_digest

    digest = directory_image_digest(cpu_image["dir"])
    assert moe("tokenize", "--no-mlflow").returncode == 0
    r = moe(
        "submit",
        "--wait",
        "--set",
        "container.runtime=charliecloud",
        "--set",
        f"container.image={cpu_image['dir']}",
        "--set",
        f"container.image_digest={digest}",
        "--set",
        "train.max_steps=4",
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    job_id = r.stdout.strip().splitlines()[0]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    run = client.search_runs([client.get_experiment_by_name("moe").experiment_id], "tags.`moe.stage` = 'train'")[0]
    assert run.data.tags["container.image_digest"] == digest
    assert run.data.tags["container.runtime"] == "charliecloud"
    assert run.data.tags["image.torch"] == "2.13.0+cpu"  # written by the job from inside the image
    assert run.data.tags["slurm.job_id"] == job_id
    assert json.loads(Path("metrics/train.json").read_text())["steps"] == 4
    result = {"image_build_s": cpu_image["build_s"], "digest": digest, "job_id": job_id}
    (workspace / "container_result.json").write_text(json.dumps(result))
