"""Heavy imports with the cycle collector paused.

Importing MLflow, matplotlib or torch's compiler stack allocates hundreds of thousands of
objects that live as long as the process, and every full collection they trigger on the way
holds the GIL for 0.15-0.4 s: five of them, 1.3 s, in a fresh process's first fit, while the
driver's threads were serving its workers. With collection paused while a thread imports, no
collection runs during the import; the new objects reach the oldest generation afterwards,
at the pace of ordinary allocation, and cost one full collection instead of several."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_importing = 0
_was_enabled = False


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
