"""The load phase, seen from the driver: a small authenticated server the training tasks
report to (`task.load_report`) while they read their partitions into their data caches, so
the driver can say how far the load has got. It keeps one (rows, of, done) per partition,
and hands a task's CPU fallback to `on_cpu_fallback` once, as soon as it hears of it."""

from __future__ import annotations

from collections.abc import Callable

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.net.auth import new_secret
from sparkdl_avg.net.frames import Connection
from sparkdl_avg.net.server import Server
from sparkdl_avg.task.load_report import LoadReport


class LoadMonitor(Server):
    def __init__(self, *, host: str, advertise: str, num_workers: int, port: int = 0,
                 name: str = "load monitor",
                 on_cpu_fallback: Callable[[int, str], None] | None = None) -> None:
        super().__init__(secret=new_secret(), host=host, port=port,
                         max_connections=num_workers, name=name)
        self.advertise, self.num_workers = advertise, num_workers
        self._loaded: dict[int, tuple[int, int, bool]] = {}
        self._on_cpu_fallback = on_cpu_fallback
        self._fallbacks: set[int] = set()

    @property
    def secret(self) -> bytes:
        return self._secret

    @property
    def reachable_at(self) -> tuple[str, int]:
        return self.advertise, self.address[1]

    def progress(self) -> tuple[int, int, int]:
        """(rows loaded, partitions heard from, partitions loaded)."""
        with self._lock:
            values = list(self._loaded.values())
        return sum(v[0] for v in values), len(values), sum(1 for v in values if v[2])

    def serve(self, conn: Connection, hello: dict) -> bool:
        """A report is the connection's introduction; nothing else is read."""
        try:
            report = LoadReport.from_meta(hello)
            if report.rank >= self.num_workers:
                raise ProtocolError(f"rank {report.rank} of {self.num_workers}", "unexpected")
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, "a task", conn)
            return False
        with self._lock:
            self._loaded[report.rank] = (report.rows, report.of, report.done)
            first = report.cpu_fallback is not None and report.rank not in self._fallbacks
            self._fallbacks.add(report.rank)
        if first and self._on_cpu_fallback is not None:
            self._on_cpu_fallback(report.rank, report.cpu_fallback)
        return False
