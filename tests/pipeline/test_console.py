"""pipeline.console: error lines never pass on torch's advice to load a file unsafely (issue 37)."""

import pickle

import pytest
import torch

from pipeline.console import without_unsafe_advice


def test_torchs_weights_only_advice_is_cut(tmp_path):
    class Planted:
        def __reduce__(self):
            return (print, ("EXECUTED",))

    path = tmp_path / "x.pt"
    torch.save({"w": torch.zeros(1), "x": Planted()}, path)
    with pytest.raises(pickle.UnpicklingError) as info:
        torch.load(path, weights_only=True)
    torch_message = str(info.value)
    assert "weights_only" in torch_message  # what torch says (and what we must not repeat)
    line = without_unsafe_advice(f"{path}: refused: not a plain tensor file ({torch_message})")
    assert line == f"{path}: refused: not a plain tensor file (the file holds objects that need unpickling, which is refused)"
    assert without_unsafe_advice("a plain message. unchanged") == "a plain message. unchanged"
