"""The initial build on an executor, for a driver that holds no frozen weights
(`driver_model="meta"`, `driver.initial_state`): one task builds `model_fn` under the fit's
seed, as every replica will, checks it takes a probe batch of the data, and returns what
trains (its values), its counted buffers and its frozen tensors' fingerprint. A failure is
returned as text, not raised, so the driver can raise it as the ModelError it is."""

from __future__ import annotations

import json
from collections.abc import Iterator

FIELDS = (("trained", "binary"), ("layout", "string"), ("counted", "binary"),
          ("frozen", "string"), ("error", "string"))


def build_task(payload: dict, batches: Iterator) -> Iterator:
    """mapInArrow's body: one row (`FIELDS`) whatever happens."""
    from sparkdl_avg.task.probe import warmed_up
    from sparkdl_avg.task.report import record_batch

    for _ in batches:  # the one input row
        pass
    warmed_up()
    try:
        row = _build(payload)
    except Exception as exc:  # noqa: BLE001 - the driver raises it, with its type's name
        row = {"trained": b"", "layout": "[]", "counted": b"", "frozen": "{}",
               "error": f"{type(exc).__name__}: {exc}"}
    yield record_batch(row, FIELDS)


def _build(payload: dict) -> dict:
    import cloudpickle
    import torch

    from sparkdl_avg._model import build_model, check_model_takes_data
    from sparkdl_avg.averaging.flat_buffer import averaged_tensors, wire_dtype
    from sparkdl_avg.averaging.frozen import Fingerprint
    from sparkdl_avg.task import worker_state

    torch.manual_seed(payload["seed"])  # as the driver and every replica build it
    model = build_model(cloudpickle.loads(payload["model_fn"]))
    check_model_takes_data(model, payload["schema"], cloudpickle.loads(payload["loss"]),
                           dtype=getattr(torch, payload["dtype"]), ranges=payload["ranges"],
                           longest=payload["longest"])
    trained = averaged_tensors(model)
    flat = torch.cat([t.detach().reshape(-1) for t in trained]).to(
        wire_dtype(trained[0].dtype)) if trained else torch.zeros(0)
    layout, counted = worker_state.pack(None, model)
    return {"trained": flat.numpy().tobytes(), "layout": json.dumps(layout),
            "counted": counted.tobytes(), "frozen": json.dumps(Fingerprint.of(model).to_dict()),
            "error": None}
