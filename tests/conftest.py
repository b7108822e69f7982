import pytest
import torch

from tests.helpers import make_corpus


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
