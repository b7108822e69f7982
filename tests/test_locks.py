import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_lock_files_match_pyproject():
    r = subprocess.run([sys.executable, str(REPO / "scripts/check_lock.py")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_dockerfile_parses_with_charliecloud_rules():
    text = (REPO / "containers/Dockerfile").read_text()
    assert "FROM $BASE_IMAGE" in text and "FROM ${" not in text  # ch-image 0.31 rejects braces
    assert "--require-hashes" in text
    assert "@sha256:" in text.split("ARG BASE_IMAGE=", 1)[1].splitlines()[0]


sys.path.insert(0, str(REPO / "scripts"))
import install_lock  # noqa: E402

LOCK = """# header
torch==2.13.0 \\
    --hash=sha256:{h} \\
    --hash=sha256:{other}
    # via moe-pipeline
cuda-toolkit==13.0.3.0 ; sys_platform == 'linux' \\
    --hash=sha256:{other}
    # via torch
nvidia-cublas==13.1.1.3 ; sys_platform == 'linux' \\
    --hash=sha256:{other}
    # via
    #   -c .lock-cpu.txt
    #   cuda-toolkit
sympy==1.14.0 \\
    --hash=sha256:{other}
    # via torch
"""


def _wheel(tmp_path, version: str) -> tuple:
    import hashlib

    from packaging.tags import sys_tags

    tag = next(iter(sys_tags()))
    whl = tmp_path / f"torch-{version}-{tag.interpreter}-{tag.abi}-{tag.platform}.whl"
    whl.write_bytes(b"a local build")
    return whl, hashlib.sha256(b"a local build").hexdigest()


def test_local_cpu_wheel_replaces_pypi_torch_and_its_cuda_libraries(tmp_path):
    whl, h = _wheel(tmp_path, "2.13.0+cpu")
    text, used = install_lock.local_lock(LOCK.format(h=h, other="0" * 64), tmp_path)
    assert used == [whl.name]
    assert "torch==2.13.0+cpu" in text and "sympy==1.14.0" in text
    assert "cuda-toolkit" not in text and "nvidia-cublas" not in text


def test_local_wheel_without_a_locked_hash_is_ignored(tmp_path):
    _wheel(tmp_path, "2.13.0+cpu")
    lock = LOCK.format(h="1" * 64, other="0" * 64)
    assert install_lock.local_lock(lock, tmp_path) == (lock, [])
    assert install_lock.local_lock(lock, tmp_path / "absent") == (lock, [])


def test_add_hashes_records_local_wheels_of_locked_versions(tmp_path):
    whl, h = _wheel(tmp_path, "2.13.0+cpu")
    lock = tmp_path / "cpu.lock"
    lock.write_text(LOCK.format(h="1" * 64, other="0" * 64))
    assert install_lock.add_hashes(lock, tmp_path) == [whl.name]
    assert f"--hash=sha256:{h}" in lock.read_text().split("cuda-toolkit")[0]
    assert install_lock.add_hashes(lock, tmp_path) == []  # idempotent


def test_cpu_lock_is_universal_and_pins_pypi_torch():
    text = (REPO / "requirements/cpu.lock").read_text()
    assert "--universal" in text.splitlines()[1] and "--no-config" in text.splitlines()[1]
    torch = next(e for e in install_lock.parse_lock(text)[1] if e.name == "torch")
    assert torch.version == "2.13.0" and len(torch.hashes) >= 12  # every PyPI wheel (+ the local build's)


@pytest.mark.slow
def test_cpu_lock_resolves_from_pypi_for_every_supported_python_and_platform():
    """uv with its configuration ignored, against https://pypi.org/simple; hashes checked per target."""
    import resolve_lock

    lock = REPO / "requirements/cpu.lock"
    found = [p for py in resolve_lock.PYTHONS for plat in resolve_lock.PLATFORMS for p in resolve_lock.problems(lock, py, plat)]
    assert not found, "\n".join(found)
