import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tests.containers import image_build
from tests.helpers import cancel_slurm_jobs_under, make_corpus, need_slurm
from tests.workspace import REPO, TINY_PARAMS, write_corpus

# The longest modules first (CI's durations, two workers, --dist loadfile hands out whole modules
# in collection order): a long module that starts last leaves the other worker idle at the end.
# The three that use the one Slurm cluster are spread out so that the two workers rarely wait for
# each other's turn on it.
SLOW_MODULES_FIRST = (
    "tests/pipeline/test_dvc_e2e.py",
    "tests/train/test_trainer.py",
    "tests/pipeline/test_slurm.py",  # cluster
    "tests/pipeline/eval/test_olmo_eval_reference.py",
    "tests/pipeline/paper/test_pipeline.py",  # cluster
    "tests/pipeline/test_local_executor.py",
    "tests/pipeline/eval/test_gold_bpb.py",
    "tests/parallel/test_grad_sync.py",
    "tests/parallel/test_layouts.py",
    "tests/train/test_layout_invariant.py",  # one spawn of four ranks, about a minute
    "tests/containers/test_image.py",  # cluster; after the image the session builds in the background (below)
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep their order


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "tokens"
    d.mkdir()
    make_corpus(d)
    return d


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


# Test workers (`make test` runs pytest-xdist with --dist loadfile: a module's tests stay on one
# worker, so its module fixtures are built once). The one local Slurm cluster (with its
# PostgreSQL and container store) is used by one module at a time, whichever worker runs it: a
# module that uses it holds an exclusive lock while it runs (and the cluster is started under the
# same lock). (xdist's --dist loadgroup does not group on pytest 9: it sets a nodeid attribute
# pytest no longer reads.)
CLUSTER_MODULES = ("tests.containers.",)  # start the cluster themselves (slurm/local/start.sh)
CLUSTER_LOCK = Path(tempfile.gettempdir()) / "moe-tests-slurm-cluster.lock"


_TURNS = [0]  # this process's holds of the lock (re-entrant: a module's hold covers its fixtures)


@contextlib.contextmanager
def cluster_turn():
    import fcntl

    if _TURNS[0]:
        _TURNS[0] += 1
        try:
            yield
        finally:
            _TURNS[0] -= 1
        return
    with open(CLUSTER_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        _TURNS[0] = 1
        try:
            yield
        finally:
            _TURNS[0] = 0
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="module", autouse=True)
def _one_module_on_the_cluster_at_a_time(request):
    name = request.module.__name__
    uses = name.startswith(CLUSTER_MODULES) or any(
        "slurm_cluster" in getattr(item, "fixturenames", ()) for item in request.session.items if getattr(item, "module", None) is request.module
    )
    if not uses:
        yield
        return
    with cluster_turn():
        leftover = cancel_slurm_jobs_under(_session_tmp_root(request))  # an earlier module's, never a user's
        if leftover:
            warnings.warn(f"cancelled Slurm jobs {leftover} an earlier test module left behind", stacklevel=1)
        try:
            yield
        finally:
            leftover = cancel_slurm_jobs_under(_session_tmp_root(request))
            if leftover:
                warnings.warn(f"cancelled Slurm jobs {leftover} that {name} left behind", stacklevel=1)


def _session_tmp_root(request) -> Path:
    """This test session's tmp root, shared by its workers (each worker's basetemp is a folder in it)."""
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    return base.parent if hasattr(request.config, "workerinput") else base


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without workers)
        config.hostile_dir = tempfile.mkdtemp(prefix="moe-hostile-")
        # The container tests' image (minutes of network and disk waits) builds beside the workers.
        config.image_build = image_build.start_in_background(config)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        image_build.stop_background(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["hostile_dir"] = node.config.hostile_dir
    node.workerinput["image_build"] = str(node.config.image_build or "")


def pytest_sessionfinish(session):
    """A worker hands its hostile-input rows to the controller, which prints the tables."""
    worker = getattr(session.config, "workerinput", None)
    hostile = sys.modules.get("tests.pipeline.hostile")
    if worker and hostile is not None and hostile.RESULTS:
        Path(worker["hostile_dir"], f"{worker['workerid']}.json").write_text(json.dumps(hostile.RESULTS))


def pytest_terminal_summary(terminalreporter, config):
    """The hostile-input tables and their counts (tests/pipeline/hostile.py), when any ran."""
    files = sorted(Path(getattr(config, "hostile_dir", "/nonexistent")).glob("*.json"))
    if files:
        from tests.pipeline import hostile

        for f in files:
            for table, rows in json.loads(f.read_text()).items():
                hostile.RESULTS.setdefault(table, {}).update({cid: tuple(v) for cid, v in rows.items()})
    hostile = sys.modules.get("tests.pipeline.hostile")
    if hostile is not None:
        for line in hostile.summary_lines():
            terminalreporter.write_line(line)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB file system (tmpfs; needs root, as CI runs): writes past it fail with ENOSPC."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A pipeline working directory with a tiny corpus and params.yaml; cwd is set to it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MOE_PIPELINE_KEY", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    write_corpus(tmp_path / "corpus")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(TINY_PARAMS, sort_keys=False))
    return tmp_path


@pytest.fixture(scope="session")
def slurm_cluster():
    if not (shutil.which("sbatch") and shutil.which("slurmctld")):
        need_slurm("Slurm is not installed (apt-get install slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0 and subprocess.run(["sinfo"], capture_output=True).returncode != 0:
        need_slurm("no running Slurm cluster and not root to start one")
    with cluster_turn():  # not two workers' start.sh at once
        r = subprocess.run(["bash", str(REPO / "slurm/local/start.sh")], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        need_slurm(f"could not start the local Slurm cluster: {r.stderr[-1500:]}")
    return True
