"""Capture and restore every RNG a training step draws from.

States are kept as tensors and plain numbers (no numpy arrays or tuples of Python objects),
so a checkpoint's RNG file loads with ``torch.load(weights_only=True)``: loading a checkpoint
never unpickles arbitrary objects.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_micro_batch(seed: int, step: int, index: int) -> None:
    """Seed torch's generators (CPU and every GPU) for micro-batch ``index`` of optimizer step
    ``step``: a function of the global position alone, so a micro-batch draws the same numbers
    whichever rank runs it and after any resume (train.layout_invariant)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) % (2**63 - 1)
    torch.manual_seed(mixed)


def rng_state(device: torch.device) -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python_version": int(version),
        "python_state": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_gauss": float(cached),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore; ValueError when ``state`` is not what :func:`rng_state` returns."""
    if "python" in state:  # written by an earlier version: tuples and a numpy array
        _set_legacy(state)
    else:
        _set(state)
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _set_legacy(state: dict[str, Any]) -> None:
    try:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(v) for v in internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"not an RNG state of this version ({type(exc).__name__}: {exc})") from None


def _set(state: dict[str, Any]) -> None:
    try:
        py = (state["python_version"], tuple(int(v) for v in state["python_state"].tolist()), state["python_gauss"])
        np_state = (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            int(state["numpy_pos"]),
            int(state["numpy_has_gauss"]),
            float(state["numpy_gauss"]),
        )
        torch_state = state["torch"]
        if not (isinstance(torch_state, torch.Tensor) and torch_state.dtype == torch.uint8):
            raise TypeError("torch state is not a uint8 tensor")
        random.setstate(py)
        np.random.set_state(np_state)
        torch.set_rng_state(torch_state)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
        raise ValueError(f"not an RNG state of this version ({type(exc).__name__}: {exc})") from None
