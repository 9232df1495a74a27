"""A task claiming its own worker key from the driver, once, before it trains.

Spark ships one closure to every task of a barrier job, so a key in the `WorkerSpec` would be
every task's. The spec carries only the launch's load-monitor secret; each task claims the
key of its rank, `HMAC(secret, "worker:<rank>")`, from the driver's `LoadMonitor`, which
hands it out to one claim per rank per launch. Spark never runs a task of a barrier stage
again within a launch: a failed task fails the stage, and Spark never retries a failed barrier
result stage ("Could not recover from a failed barrier ResultStage"), so the driver's restart
loop makes a new launch, with a new monitor, where every task claims afresh. The task's attempt
number (`TaskContext.attemptNumber()`) goes along for the log only: it is the claimant's word.
Elastic and async fits run a normal stage, whose failed task Spark runs again within the
launch: there the attempt is Spark's task attempt id, and a later attempt's claim is answered
(`driver.load_monitor`).

A claim is idempotent: `enrol` draws a random claim id once and sends it on every retry, and
the monitor answers the claim id that claimed a rank again (a reply lost on the way is sent
anew), refusing any other ("claimed"). A holder of the launch secret who claims a rank first
gets its key, but the real task's claim is then refused and the fit fails naming it: an
impostor is found out, never silent (`docs/guide/security.md` says what it can do meanwhile).

The key travels XORed with a pad, `HMAC(the task's key at the monitor, "enrol|" + nonce)`
for a fresh nonce, so an eavesdropper on the driver's network without the launch secret
learns nothing from it (the load monitor speaks plain TCP).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from sparkdl_avg.net import fields
from sparkdl_avg.net.auth import Credential, role_key, role_of
from sparkdl_avg.net.message_base import Message

CLAIM_ID_BYTES = 16
"""A claim id's random bytes: no two claims for a rank draw the same one."""

@dataclass(frozen=True, slots=True)
class Enrolment(Message):
    """A task's claim (its AUTH's hello at the load monitor): the key of `rank`, by the claim
    `claim_id` (`CLAIM_ID_BYTES` random bytes, hex; the same on every retry). `attempt`: Spark's
    attempt number of the task, for the log only."""

    rank: int
    attempt: int
    claim_id: str

    def check(self) -> None:
        if self.rank < 0 or self.attempt < 0:
            raise self.invalid(f"rank {self.rank}, attempt {self.attempt}")
        fields.hex_string("claim_id", self.claim_id, self)
        if len(self.claim_id) != 2 * CLAIM_ID_BYTES:
            raise self.invalid(f"a claim id of {len(self.claim_id) // 2} bytes")


def is_enrolment(hello: dict) -> bool:
    """Whether a hello at the load monitor is a claim (else a `LoadReport`)."""
    return "attempt" in hello


def seal(load_secret: bytes, rank: int, nonce: bytes, key: bytes) -> bytes:
    """`key` XORed with a pad only holders of `load_secret` can make; its own inverse."""
    pad = hmac.new(role_key(load_secret, role_of(rank)), b"enrol|" + nonce,
                   hashlib.sha256).digest()
    return bytes(a ^ b for a, b in zip(key, pad, strict=True))


def enrol(address: tuple[str, int], load_secret: bytes, rank: int, attempt: int,
          limit_s: float) -> Credential:
    """The credential of worker `rank`, claimed from the load monitor at `address`. A lost or
    busy connection (or reply) is retried, by the same claim, within `limit_s` (the fit's
    connect_timeout), then raised as a `WorkerLostError` (a restart
    makes a new launch, which enrols afresh); a refused claim raises `PeerRefused` with the
    monitor's reason ("claimed": someone claimed this rank first), which fails the fit (in an
    elastic one, the task ends without training: `entry`)."""
    from sparkdl_avg._errors import WorkerLostError
    from sparkdl_avg.net import messages as msg
    from sparkdl_avg.net.auth import HANDSHAKE_S, authenticate_to_server
    from sparkdl_avg.net.dial import dial, retryable
    from sparkdl_avg.net.frames import connect

    claim = Enrolment(rank, attempt, os.urandom(CLAIM_ID_BYTES).hex())

    def once(connect_s: float, until: float, tries: int) -> bytes:
        conn = connect(address, timeout=connect_s, max_payload=0, tries=tries, until=until)
        try:
            authenticate_to_server(conn, load_secret, claim)
            reply, _ = msg.expect(conn, msg.Enrolled)
        finally:
            conn.close()
        return seal(load_secret, rank, bytes.fromhex(reply.nonce), bytes.fromhex(reply.sealed))

    try:
        key = dial(once, limit_s, HANDSHAKE_S)  # the monitor's own handshake limit
    except Exception as exc:
        if not retryable(exc):
            raise
        raise WorkerLostError(f"partition {rank} could not claim its worker key from the "
                              f"driver at {address[0]}:{address[1]}: {exc}") from exc
    return Credential(role_of(rank), key)
