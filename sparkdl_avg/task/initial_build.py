"""The initial build on an executor, for a driver that holds no frozen weights
(`driver_model="meta"`, `driver.meta_model`): one task builds `model_fn` under the fit's
seed, as every replica will, fingerprints its frozen tensors, checks it takes a probe batch
of the data (with `fit(preprocess=)`, the driver's sample of real rows), and returns what
trains (its names, shapes and values), its counted buffers and the fingerprint. The values
go in rows of at most `CHUNK_BYTES` (a result row, and an Arrow binary cell, has limits far
below a large model's); a failure is returned as text, not raised, so the driver raises it
as the error it is."""

from __future__ import annotations

import json
from collections.abc import Iterator

FIELDS = (("part", "int"), ("values", "binary"), ("meta", "string"), ("error", "string"))
"""`part` numbers the rows; row 0's `meta` is JSON: trained (names and shapes), layout and
counted (hex) of the counted buffers, frozen (the fingerprint)."""
CHUNK_BYTES = 32 << 20


def build_task(payload: dict, batches: Iterator) -> Iterator:
    """mapInArrow's body: the rows (`FIELDS`), or one row with the error."""
    from sparkdl_avg.task.probe import warmed_up
    from sparkdl_avg.task.report import record_batch

    for _ in batches:  # the one input row
        pass
    warmed_up()
    try:
        meta, values = _build(payload)
    except Exception as exc:  # noqa: BLE001 - the driver raises it, as its class
        yield record_batch({"part": 0, "values": b"", "meta": None,
                            "error": f"{type(exc).__name__}: {exc}"}, FIELDS)
        return
    for part, start in enumerate(range(0, max(len(values), 1), CHUNK_BYTES)):
        yield record_batch({"part": part, "values": values[start:start + CHUNK_BYTES],
                            "meta": json.dumps(meta) if part == 0 else None,
                            "error": None}, FIELDS)


def _build(payload: dict) -> tuple[dict, bytes]:
    import cloudpickle
    import torch

    from sparkdl_avg._model import check_model_takes_data, settle_modes
    from sparkdl_avg.averaging.flat_buffer import averaged_tensors, wire_dtype
    from sparkdl_avg.averaging.frozen import Fingerprint
    from sparkdl_avg.task import worker_state

    torch.manual_seed(payload["seed"])  # as the driver and every replica build it
    model = settle_modes(cloudpickle.loads(payload["model_fn"])())
    frozen = Fingerprint.of(model).to_dict()  # as built: before any forward
    check_model_takes_data(model, objective=cloudpickle.loads(payload["loss"]),
                           dtype=getattr(torch, payload["dtype"]), **payload["probe"])
    trained = averaged_tensors(model)
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    wire = wire_dtype(trained[0].dtype)
    values = torch.cat([t.detach().reshape(-1).cpu().to(wire) for t in trained])
    layout, counted = worker_state.pack(None, model)
    meta = {"trained": [[names[id(t)], list(t.shape)] for t in trained],
            "layout": layout, "counted": counted.tobytes().hex(), "frozen": frozen}
    return meta, values.numpy().tobytes()
