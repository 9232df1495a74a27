"""`overlap_averaging` in a task: a round's exchange runs on a thread of its own while the
worker computes the next round; when it returns, the replica becomes the average plus what the
worker learned meanwhile, x <- A_r + (x - S_r), S_r being the replica it pushed (CoCoD-SGD:
Shen et al., "Faster Distributed Deep Net Training: Computation and Communication Decoupled
Stochastic Gradient Descent", IJCAI 2019).

The transport does not change: it averages a detached copy of the replica (`Snapshot`, a
`WireBuffer` like the model's own `FlatBuffer`) instead of the model's own tensors."""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.averaging.flat_buffer import FlatBuffer, WireBuffer, sync_device
from sparkdl_avg.averaging.transport import RoundReply, RoundReport, Transport


class Snapshot(WireBuffer):
    """A replica's flat values as pushed (`sent`), and the copy the transport averages in
    place (`flat`, with its host copy for the wire)."""

    def __init__(self, source: FlatBuffer) -> None:
        self.flat = torch.empty_like(source.flat)
        self.sent = torch.empty_like(source.flat)
        if source.host is source.flat:
            self.host = self.flat
        else:
            self.host = torch.empty_like(source.host,
                                         pin_memory=source.flat.device.type == "cuda")
        self.array = self.host.numpy()

    def take(self, source: FlatBuffer) -> None:
        """The replica's current values, before it computes on."""
        self.sent.copy_(source.flat)
        self.flat.copy_(source.flat)
        sync_device(self.flat)

    def correct(self, replica: FlatBuffer) -> None:
        """The replica (which went on from `sent`) moved onto the average: x - sent + A."""
        replica.flat.sub_(self.sent).add_(self.flat)


class OverlappedExchange:
    """At most one exchange in flight; `close()` waits for it (its socket or collective must
    be free before anything else uses them) and stops the thread."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sparkdl-avg-exchange")
        self._snapshot: Snapshot | None = None
        self._pending: Future | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def begin(self, report: RoundReport, replica: FlatBuffer) -> None:
        """Push this replica (a copy of it) and take its average, off the caller's thread."""
        if self._snapshot is None or self._snapshot.flat.numel() != replica.flat.numel():
            self._snapshot = Snapshot(replica)  # optimizer state joined the buffer
        self._snapshot.take(replica)
        self._pending = self._thread.submit(self._transport.exchange, report, self._snapshot)

    def finish(self, replica: FlatBuffer) -> RoundReply:
        """Wait for the exchange in flight; unless it stops the fit, move `replica` (the same
        tensors it was begun with) onto its average."""
        pending, self._pending = self._pending, None
        reply = pending.result()  # the transport's own timeouts bound this
        if reply.evaluate or reply.checkpoint:
            raise ProtocolError("the driver asked for an evaluation or a checkpoint after a "
                                "round it had let the workers overlap", "unexpected")
        if not reply.stop:
            with torch.no_grad():
                self._snapshot.correct(replica)
        return reply

    def close(self) -> RoundReply | None:
        """After a failure too: let the exchange in flight end (the driver answers a push it
        got; the transport's timeouts bound the rest), so that what is sent next does not
        cross it. Returns its reply, if it had one."""
        pending, self._pending, reply = self._pending, None, None
        if pending is not None:
            with contextlib.suppress(Exception):
                reply = pending.result()
        self._thread.shutdown(wait=True)
        return reply
