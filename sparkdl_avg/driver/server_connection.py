"""The async driver's connection to the parameter server, all its shards: it restarts the
fit's own server processes (sidecars) that died, and connects again to a user's server that
came back on its port (`ServerConnection`)."""

from __future__ import annotations

import logging
import time

from sparkdl_avg._errors import TrainingError, WorkerLostError, peer_gone
from sparkdl_avg.driver.restarts import Restarts
from sparkdl_avg.net.dial import pause_s, retryable
from sparkdl_avg.ps.sidecar import Sidecar

log = logging.getLogger("sparkdl_avg")


class ServerConnection:
    """The driver's connection to the parameter server (all its shards). A sidecar found
    dead is restarted from its checkpoint (on the same port, where the workers reconnect);
    each restart, of any shard, counts against max_failures. A user's server (`ps_address`)
    is connected to again, as its workers do, for up to reconnect_timeout: a `ps serve
    --shards` supervisor restarts a shard on its port."""

    def __init__(self, sidecars: list[Sidecar], connect, restarts: Restarts, run, *,
                 reconnect_s: float = 0.0) -> None:
        self.sidecars, self._connect, self._restarts, self._run = (sidecars, connect,
                                                                    restarts, run)
        self._reconnect_s = reconnect_s
        self.ps = connect()

    def call(self, fn, step: int):
        try:
            return fn(self.ps)
        except (OSError, ConnectionError) as exc:
            # a refusal, or a slow server's timeout, would come again: not reconnected
            gone = peer_gone(exc) and not isinstance(exc, TimeoutError)
            if not (self.revive(step, grace_s=2.0) or (gone and self._reconnect())):
                raise TrainingError(f"lost the parameter server: {exc}") from exc
            return fn(self.ps)

    def _reconnect(self) -> bool:
        """A user's server: connect again while it is away, for up to reconnect_timeout."""
        if self.sidecars:  # ours are alive (`revive`): what broke is not their absence
            return False
        deadline, attempt = time.monotonic() + self._reconnect_s, 0
        self.ps.close()
        while True:
            try:
                self.ps = self._connect()
                return True
            except OSError as exc:
                if not retryable(exc) or time.monotonic() > deadline:
                    log.warning("could not connect to the parameter server again: %s", exc)
                    return False
                time.sleep(min(0.5, pause_s(attempt)))
                attempt += 1

    def revive(self, step: int, grace_s: float = 0.0) -> bool:
        """Restart the sidecars that died; True if one did."""
        dead = [(k, s) for k, s in enumerate(self.sidecars) if not s.alive(grace_s)]
        if not dead:
            return False
        self.ps.close()
        for k, sidecar in dead:
            which = f"shard {k} of {len(self.sidecars)} of " if len(self.sidecars) > 1 else ""
            self._restarts.record(WorkerLostError(
                f"{which}the parameter server process died (exit code "
                f"{sidecar.returncode})"), "the server's last checkpoint", step=step,
                check_cluster_after=False)
            sidecar.restart()
        self._run.log_metrics({"ps_restarts": sum(s.restarts for s in self.sidecars)},
                              step=step)
        self.ps = self._connect()
        return True

    def close(self) -> None:
        self.ps.close()
