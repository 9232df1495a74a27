"""The driver's cycle collector around heavy imports.

Importing MLflow, matplotlib or torch's compiler stack allocates hundreds of thousands of
objects that live as long as the process, and every full collection they trigger on the way
holds the GIL for 0.15-0.4 s: five of them, 1.3 s, in a fresh process's first fit, while the
driver's threads were serving its workers. With collection paused while a thread imports, no
collection runs during the import; the new objects reach the oldest generation afterwards,
at the pace of ordinary allocation, and cost one full collection instead of several.

That one collection (0.4-0.5 s holding the GIL) would fall wherever an allocation crosses
the collector's threshold: in the next fit, measured in the middle of its rounds or its
pictures. Armed (`arm_full_collection`), it runs instead on a thread of its own while the
driver waits on the JVM for a Spark job (`full_collection_beside`), whose wait needs no GIL.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

_lock = threading.Lock()
_importing = 0
_was_enabled = False
_armed = False
_AFTER_S = 0.05


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Automatic collection off until the last thread inside leaves (then on again, unless
    it was off when the first came in)."""
    global _importing, _was_enabled
    with _lock:
        if _importing == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _importing += 1
    try:
        yield
    finally:
        with _lock:
            _importing -= 1
            if _importing == 0 and _was_enabled:
                gc.enable()


def arm_full_collection() -> None:
    """Heavy imports left a full collection due: the next `full_collection_beside` runs it."""
    global _armed
    _armed = True


@contextlib.contextmanager
def full_collection_beside() -> Iterator[None]:
    """Around a wait on the JVM (a Spark job's `collect`): the armed full collection, if any,
    runs on a thread of its own meanwhile, once."""
    global _armed
    with _lock:
        armed, _armed = _armed, False
    if armed:
        threading.Thread(target=_collect_once_waiting, name="sparkdl-avg-collect",
                         daemon=True).start()
    yield


def _collect_once_waiting() -> None:
    time.sleep(_AFTER_S)  # the caller sends its job first: that needs the GIL for a moment
    gc.collect()
