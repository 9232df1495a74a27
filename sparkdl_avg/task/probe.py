"""The probe task (`driver.probe`): one per training slot, before training. It reports to the
driver's probe server the way a training task will connect (an authenticated connection to
the advertised address), and says whether this executor has a local directory for spill
files. It also leaves its Python worker importing what training needs (`warm_up`): Spark
reuses the worker for the training task, which then starts warm."""

from __future__ import annotations

import socket
from collections.abc import Iterator

FIELDS = (("partition", "int"), ("host", "string"), ("unreachable", "string"),
          ("local_dirs", "string"))
"""A probe task's row (`report.struct_type` gives its Spark schema)."""
CONNECT_S = 5.0
"""How long a probe task tries to reach the driver: a firewall that drops packets costs this."""


_warming = None
"""This worker's warm-up thread, once a probe task has started one."""


def warmed_up(timeout: float = 300.0) -> None:
    """Called first by a training task: wait for this worker's warm-up to finish its
    imports. Two threads importing torch's modules at once can deadlock on torch's
    circular imports (Python raises `_DeadlockError` in one of them), so a task imports
    only once the warm-up is done."""
    if _warming is not None:
        _warming.join(timeout)


def warm_up() -> None:
    """Import torch, the machinery its optimizers load on first use, and the training task's
    modules, on a thread of this worker, while the driver goes on validating the data. The
    training task waits for it (`warmed_up`) instead of importing them itself."""
    import threading

    global _warming

    if _warming is None or not _warming.is_alive():
        _warming = threading.Thread(target=import_for_training, name="sparkdl-avg-warm-up",
                                    daemon=True)
        _warming.start()


def import_for_training() -> bool:
    """Import what a training task needs (`warm_up`, `task.warm_daemon`); whether all of it
    imported. Only a head start: a failure is the task's to report when it imports them."""
    from sparkdl_avg._gc_pause import collector_paused

    try:
        with collector_paused():
            import torch._dynamo  # noqa: F401 - the first optimizer imports it, ~1.5 s cold

            from sparkdl_avg.averaging import driver_channel, flat_buffer  # noqa: F401
            from sparkdl_avg.data import batches, partition  # noqa: F401
            from sparkdl_avg.task import async_loop, entry, replica, sync_loop  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def probe_task(address: tuple[str, int], secret: bytes, batches: Iterator) -> Iterator:
    from pyspark import BarrierTaskContext

    from sparkdl_avg.data.spill import local_dirs, unusable
    from sparkdl_avg.net.auth import authenticate_to_server
    from sparkdl_avg.net.frames import connect
    from sparkdl_avg.task.load_report import LoadReport
    from sparkdl_avg.task.report import record_batch

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
    warm_up()  # once the probe's own work is done: its imports would hold the GIL
    yield record_batch({"partition": rank, "host": socket.gethostname(),
                        "unreachable": unreachable, "local_dirs": dirs_problem}, FIELDS)
