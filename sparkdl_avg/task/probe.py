"""The probe task (`driver.probe`): one per training slot, before training. It reports to the
driver's probe server the way a training task will connect (an authenticated connection to
the advertised address), and says whether this executor has a local directory for spill
files."""

from __future__ import annotations

import socket
from collections.abc import Iterator

SCHEMA = "partition int, host string, unreachable string, local_dirs string"
CONNECT_S = 5.0
"""How long a probe task tries to reach the driver: a firewall that drops packets costs this."""


def probe_task(address: tuple[str, int], secret: bytes, batches: Iterator) -> Iterator:
    import pyarrow as pa
    from pyspark import BarrierTaskContext

    from sparkdl_avg.data.spill import local_dirs, unusable
    from sparkdl_avg.net.auth import authenticate_to_server
    from sparkdl_avg.net.frames import connect
    from sparkdl_avg.task.load_report import LoadReport

    for _ in batches:  # one row a task: nothing to read
        pass
    rank = BarrierTaskContext.get().partitionId()
    unreachable = None
    try:
        conn = connect(address, timeout=CONNECT_S, max_payload=0)
        try:
            authenticate_to_server(conn, secret, LoadReport(rank=rank, rows=0, of=0, done=True))
        finally:
            conn.close()
    except OSError as exc:  # refused, timed out, no such host; ProtocolError included
        unreachable = f"{type(exc).__name__}: {exc}"[:500]
    problems = [f"{d}: {why}" for d in local_dirs() if (why := unusable(d, 0)) is not None]
    dirs_problem = "; ".join(problems) if len(problems) == len(local_dirs()) else None
    yield pa.RecordBatch.from_pydict(
        {"partition": [rank], "host": [socket.gethostname()], "unreachable": [unreachable],
         "local_dirs": [dirs_problem]},
        schema=pa.schema([("partition", pa.int32()), ("host", pa.string()),
                          ("unreachable", pa.string()), ("local_dirs", pa.string())]))
