"""A task's side of the "driver" transport: one authenticated TCP connection to the driver's
`coordinator`, every wait bounded."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from sparkdl_avg.averaging.coordinator import MAX_STATE_FACTOR
from sparkdl_avg.averaging.flat_buffer import WireBuffer
from sparkdl_avg.averaging.transport import RoundReply, RoundReport, StartPoint, Transport
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import HANDSHAKE_S, Credential, authenticate_to_server
from sparkdl_avg.net.dial import dial
from sparkdl_avg.net.frames import Connection, connect
from sparkdl_avg.net.tls import client_context


class DriverChannel(Transport):
    def __init__(self, address: tuple[str, int], key: Credential, *, connect_timeout: float,
                 reply_timeout: float, tls_ca_pem: str | None = None) -> None:
        """`key`: this worker's own, claimed at the load monitor (`task.enrolment`).
        `connect_timeout`: for connecting (retried while the driver is busy) and for the first
        parameters, which come once every worker has loaded its partition. `reply_timeout`:
        for each later average."""
        self._address, self._key = address, key
        self._connect_timeout, self._reply_timeout = connect_timeout, reply_timeout
        self._tls = client_context(tls_ca_pem) if tls_ca_pem else None
        self._conn: Connection | None = None

    def open(self, hello: msg.WorkerHello) -> None:
        def attempt(connect_s: float, until: float, tries: int) -> Connection:
            conn = connect(self._address, timeout=connect_s, max_payload=1 << 20,
                           tls=self._tls, tries=tries, until=until)
            try:
                authenticate_to_server(conn, self._key, hello)
            except BaseException:
                conn.close()
                raise
            return conn

        # the handshake gets what the driver gives it (HANDSHAKE_S): a client that gave up
        # sooner would leave the driver holding its rank for a dead connection
        self._conn = dial(attempt, self._connect_timeout, HANDSHAKE_S)
        self._conn.deadline = None
        self._conn.set_timeout(self._connect_timeout)

    def receive_start(self, params: np.ndarray) -> StartPoint:
        start, _ = msg.expect(self._conn, msg.Average, into=msg.into_checked(params, "the driver"))
        # The driver times out a hung worker after round_timeout and names it; the others,
        # waiting on that worker's average, must not time out first and take the blame.
        self._conn.set_timeout(self._reply_timeout)
        # optimizer state (at checkpoints, and on restart) may be up to 3x the parameters
        self._conn.max_payload = MAX_STATE_FACTOR * params.nbytes + (1 << 20)
        state = None
        if start.state_follows:
            frame, payload = msg.expect(self._conn, msg.State)
            state = (frame.layout, payload)
        return StartPoint(round=start.round + 1, state=state, wait_next=start.wait_next,
                          evaluate=start.evaluate)

    def exchange(self, report: RoundReport, flat: WireBuffer) -> RoundReply:
        params = flat.gather()
        msg.send(self._conn, msg.Push(**dataclasses.asdict(report), **msg.tensor(params)),
                 params)
        reply, _ = msg.expect(self._conn, msg.Average, into=msg.into_checked(params, "the driver"))
        flat.scatter()
        return RoundReply(evaluate=reply.evaluate, checkpoint=reply.checkpoint,
                          stop=reply.stop, wait_next=reply.wait_next)

    def send(self, message: msg.Message, payload=None) -> None:
        msg.send(self._conn, message, payload)

    def expect(self, cls: type[msg.M]) -> msg.M:
        return msg.expect(self._conn, cls)[0]

    @property
    def local_address(self) -> str:
        """The address this task reaches the driver from: its cluster address."""
        return self._conn.sock.getsockname()[0]

    def send_state(self, layout: list, payload: np.ndarray) -> None:
        msg.send(self._conn, msg.State(layout=layout), payload)

    def send_eval(self, result: msg.Eval, payload: np.ndarray | None = None) -> None:
        msg.send(self._conn, result, payload)

    def done(self, layout: list, payload: np.ndarray) -> None:
        msg.send(self._conn, msg.Done(layout=layout), payload)

    def fail(self, message: str, final: bool) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                msg.send(self._conn, msg.WorkerFailed(message=message[:4000], final=final))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
