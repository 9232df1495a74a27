"""What a worker holds beyond the averaged parameters, as (layout, bytes) and back: its
optimizer state and the model's integer buffers (BatchNorm's `num_batches_tracked`). This is
how it reaches a checkpoint and returns to a restarted worker. No pickle: the layout is JSON,
the tensors raw bytes."""

from __future__ import annotations

import numpy as np
import torch

from sparkdl_avg._errors import ModelError, ProtocolError
from sparkdl_avg.averaging.flat_buffer import counted_buffers

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.bool)}


_BUFFERS = -1
"""The layout's "parameter index" of the model's integer buffers."""
_SCALER = -2
"""... and of the fp16 gradient scaler's state (its scale and growth counter)."""


def pack(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module,
         scaler=None, extra: list[tuple[int, dict]] = ()) -> tuple[list, np.ndarray]:
    """`optimizer.state_dict()["state"]` (None: none), the model's counted buffers and the
    transport's `extra` entries (a compression residual) as a JSON-able layout and one uint8
    array.

    Layout entries: [param index, key, "tensor", dtype, shape, offset, nbytes] or
    [param index, key, "value", number]; param index -1 holds buffers by name."""
    buffers = counted_buffers(model)
    state_items = sorted(optimizer.state_dict()["state"].items()) if optimizer else []
    scaler_state = scaler.state_dict() if scaler is not None else {}
    return pack_entries(([(_BUFFERS, buffers)] if buffers else []) +
                        ([(_SCALER, scaler_state)] if scaler_state else []) + state_items
                        + list(extra))


def pack_entries(entries: list[tuple[int, dict]]) -> tuple[list, np.ndarray]:
    """(index, {key: tensor or number}) entries as a JSON-able layout and one uint8 array
    (`pack`'s format; the outer optimizer's state travels so too)."""
    layout: list = []
    chunks: list[np.ndarray] = []
    offset = 0
    for index, state in entries:
        for key in sorted(state):
            value = state[key]
            if isinstance(value, torch.Tensor):
                name = str(value.dtype).removeprefix("torch.")
                if name not in _DTYPES:
                    raise ModelError(f"optimizer state {key!r} has dtype {name}, which "
                                     "checkpoints cannot hold; use checkpoint_every=0")
                raw = value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
                layout.append([int(index), key, "tensor", name, list(value.shape), offset,
                               int(raw.nbytes)])
                chunks.append(raw)
                offset += raw.nbytes
            elif isinstance(value, (int, float, bool)) or value is None:
                layout.append([int(index), key, "value", value])
            else:
                raise ModelError(f"optimizer state {key!r} of type {type(value).__name__} "
                                 "cannot be checkpointed; use checkpoint_every=0")
    payload = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return layout, payload


def restore(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module, layout: list,
            payload, scaler=None) -> None:
    """Load a `pack`ed state into `optimizer` (None: buffers only), `model` (built over the
    same parameters) and `scaler` (fp16's gradient scaler, when there is one). Entries of
    other negative indices (the exchange's residual) are not the optimizer's: skipped."""
    state = unpack(layout, payload)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, value in state.pop(_BUFFERS, {}).items():
            if name not in buffers or buffers[name].shape != value.shape:
                raise ProtocolError(f"malformed optimizer state: no buffer {name!r} of shape "
                                    f"{tuple(value.shape)}")
            buffers[name].copy_(value)
    scaler_state = state.pop(_SCALER, {})
    if scaler is not None and scaler_state:
        scaler.load_state_dict(scaler_state)
    if optimizer is None:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: values for index, values in state.items() if index >= 0}
    for index, values in state.items():
        if index < len(params):
            _in_layout_of(params[index], values)
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


def unpack(layout: list, payload) -> dict[int, dict]:
    """A `pack_entries` layout and its bytes back into {index: {key: tensor or number}};
    a malformed one is a ProtocolError."""
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
    return state


def _in_layout_of(param: torch.Tensor, values: dict) -> None:
    """Each state tensor shaped like `param` in `param`'s memory format (a channels_last
    conv's Adam moments channels_last too). Packing flattened them in logical order, and
    `load_state_dict` keeps the strides it is given; the fused Adam step assumes a parameter,
    its gradient and its moments share one layout: on the CPU it silently mixes up elements
    of differently strided ones, on CUDA it refuses them."""
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.shape == param.shape \
                and value.stride() != param.stride():
            # empty_like keeps a dense tensor's strides; the copy runs in logical order
            values[key] = torch.empty_like(param, dtype=value.dtype, device="cpu") \
                .copy_(value)
