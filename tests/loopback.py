"""A sync coordinator on 127.0.0.1 for tests that speak to it over the wire (no Spark job
behind it: `check_job` never reports a failure)."""

from __future__ import annotations

import numpy as np

from sparkdl_avg.averaging.coordinator import Coordinator


def coordinator(secret: bytes, workers: int = 1, *, timeout: float = 10, numel: int = 4,
                tls=None) -> Coordinator:
    return Coordinator(host="127.0.0.1", advertise="127.0.0.1", num_workers=workers,
                       secret=secret, timeout=timeout, dtype=np.float32, model_numel=numel,
                       check_job=lambda wait: None, tls=tls)
