"""The parameter server's checkpoint file: its arrays (parameters, the rule's state) and a JSON
`meta` in one `.npz`, written through a temporary file and a rename so a reader never sees
half of one, and read without unpickling."""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from sparkdl_avg._background import BackgroundWriter


def save(path: str, item: tuple[dict, dict]) -> None:
    arrays, meta = item
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    os.replace(tmp, path)


def writer(path: str) -> BackgroundWriter:
    """Saves (arrays, meta) to `path` on a thread of its own, the newest pending first."""
    return BackgroundWriter(functools.partial(save, path), f"the server checkpoint {path}")


def load(path: str) -> tuple[dict, dict]:
    """(arrays, meta) as `save` wrote them."""
    with np.load(path, allow_pickle=False) as saved:
        meta = json.loads(saved["meta"].tobytes())
        arrays = {k: saved[k].copy() for k in saved.files if k != "meta"}
    return arrays, meta
