"""A background writer where the newest item wins: used for the fit's checkpoints and the
parameter server's. Saving never blocks training, and when saving lags, only the newest
pending item waits (an older one is superseded)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("sparkdl_avg")


class BackgroundWriter:
    """`submit(item)` hands an item to `save` on a thread of its own. Failures are logged
    and counted in `errors`, the first kept in `error` (and said in `failure`), never raised
    here: the owner decides (the parameter server goes on serving, as the next save may
    succeed, and reports it to the driver; a fit fails on it: `driver.checkpoints.check_saved`,
    `driver.asynchronous.check_server_saved`)."""

    def __init__(self, save: Callable[[object], None], what: str) -> None:
        self._save, self.what = save, what
        self.errors = 0
        self.error: Exception | None = None
        self._pending: object | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="sparkdl-avg-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def failure(self) -> str | None:
        """The first failed save, said for the user: "could not save <what>: <error>"."""
        return None if self.error is None else f"could not save {self.what}: {self.error!r}"

    def submit(self, item: object) -> None:
        with self._cond:
            self._pending = item
            self._cond.notify_all()

    def close(self, timeout: float = 600.0) -> None:
        """Save what is pending, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                item, self._pending = self._pending, None
            if item is None:
                return
            try:
                self._save(item)
            except Exception as exc:
                self.errors += 1
                self.error = self.error or exc
                log.warning("could not save %s", self.what, exc_info=True)
