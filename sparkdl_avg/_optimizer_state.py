"""A worker's optimizer state as (layout, bytes) and back: how it reaches a checkpoint and
returns to a restarted worker. No pickle: the layout is JSON, the tensors raw bytes."""

from __future__ import annotations

import numpy as np
import torch

from sparkdl_avg._errors import ProtocolError

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.bool)}


def pack(optimizer: torch.optim.Optimizer) -> tuple[list, np.ndarray]:
    """`optimizer.state_dict()["state"]` as a JSON-able layout and one uint8 array.

    Layout entries: [param index, key, "tensor", dtype, shape, offset, nbytes] or
    [param index, key, "value", number]."""
    layout: list = []
    chunks: list[np.ndarray] = []
    offset = 0
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                name = str(value.dtype).removeprefix("torch.")
                if name not in _DTYPES:
                    raise TypeError(f"optimizer state {key!r} has unsupported dtype {name}")
                raw = value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
                layout.append([int(index), key, "tensor", name, list(value.shape), offset,
                               int(raw.nbytes)])
                chunks.append(raw)
                offset += raw.nbytes
            elif isinstance(value, (int, float, bool)) or value is None:
                layout.append([int(index), key, "value", value])
            else:
                raise TypeError(f"optimizer state {key!r} of type {type(value).__name__} "
                                "cannot be checkpointed")
    payload = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return layout, payload


def restore(optimizer: torch.optim.Optimizer, layout: list, payload) -> None:
    """Load a `pack`ed state into `optimizer` (built over the same parameters)."""
    data = memoryview(payload).cast("B") if payload is not None else memoryview(b"")
    state: dict[int, dict] = {}
    try:
        for entry in layout:
            index, key, kind = int(entry[0]), str(entry[1]), entry[2]
            if kind == "value":
                state.setdefault(index, {})[key] = entry[3]
                continue
            name, shape, offset, nbytes = entry[3], entry[4], int(entry[5]), int(entry[6])
            if kind != "tensor" or name not in _DTYPES or offset < 0 \
                    or offset + nbytes > len(data):
                raise ValueError(f"bad entry {entry!r}")
            dtype = _DTYPES[name]
            if nbytes == 0:
                state.setdefault(index, {})[key] = torch.empty(shape, dtype=dtype)
                continue
            raw = torch.frombuffer(bytearray(data[offset:offset + nbytes]), dtype=torch.uint8)
            state.setdefault(index, {})[key] = raw.view(dtype).reshape(shape)
    except (ValueError, TypeError, IndexError, RuntimeError) as exc:
        raise ProtocolError(f"malformed optimizer state: {exc}") from None
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
