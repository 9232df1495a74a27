"""A task telling the driver how far it has loaded its partition (`driver.load_monitor`).

Each report is one short authenticated connection whose introduction is the report itself,
sent at most every `REPORT_EVERY_S` and once at the end. Progress only: a report that
cannot be delivered is dropped, and after a few failures the task stops trying."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sparkdl_avg.net.message_base import MAX_ERROR_CHARS, Message

REPORT_EVERY_S = 2.0
_TIMEOUT_S = 5.0
_GIVE_UP_AFTER = 3


@dataclass(frozen=True, slots=True)
class LoadReport(Message):
    """Rows of partition `rank` in its data cache so far, of `of`; `done` when all are;
    `cpu_fallback`: why the task trains on the CPU though Spark gave it a GPU (the driver
    says so before training, not after it)."""

    rank: int
    rows: int
    of: int
    done: bool
    cpu_fallback: str | None = None

    def check(self) -> None:
        if not 0 <= self.rows <= self.of or self.rank < 0:
            raise self.invalid(f"rank {self.rank}, {self.rows} rows of {self.of}")
        if self.cpu_fallback is not None and len(self.cpu_fallback) > MAX_ERROR_CHARS:
            raise self.invalid(f"a cpu_fallback of {len(self.cpu_fallback)} characters")


class LoadReporter:
    def __init__(self, address: tuple[str, int] | None, secret: bytes, rank: int,
                 of: int, cpu_fallback: str | None = None) -> None:
        self.address, self.secret, self.rank, self.of = address, secret, rank, of
        self.cpu_fallback = cpu_fallback[:MAX_ERROR_CHARS] if cpu_fallback else None
        self._last, self._failures = 0.0, 0

    def __call__(self, rows: int, done: bool = False) -> None:
        """Report `rows` loaded, unless a report went out under REPORT_EVERY_S ago."""
        now = time.monotonic()
        if self.address is None or self._failures >= _GIVE_UP_AFTER or \
                (not done and now - self._last < REPORT_EVERY_S):
            return
        self._last = now
        from sparkdl_avg.net.auth import authenticate_to_server
        from sparkdl_avg.net.frames import connect

        try:
            conn = connect(self.address, timeout=_TIMEOUT_S, max_payload=0)
            try:
                authenticate_to_server(conn, self.secret, LoadReport(
                    rank=self.rank, rows=min(rows, self.of), of=self.of, done=done,
                    cpu_fallback=self.cpu_fallback))
            finally:
                conn.close()
        except OSError:  # ProtocolError included: progress is not worth failing for
            self._failures += 1
