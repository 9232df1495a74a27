"""Who an elastic sync fit's rounds average (`TrainConfig.min_workers`): the workers present.

A worker whose connection drops, who reports a failure a retry may cure, or who sends nothing
for round_timeout leaves the fit at once; its task, which Spark retries alone, connects again
(as any late task does) and waits in `joining` until the next round boundary, where the
coordinator sends it the global parameters and it trains from that round's place in its
partition. Each loss and return is one record of `FitResult.failures`: partition, attempt,
the round it was lost in and the round it trained again from (as the history numbers
rounds: 1 is the first), the seconds away and the rows it skipped meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import Connection


class Membership:
    """The coordinator's bookkeeping of an elastic fit's comings and goings; the coordinator
    calls it under its lock."""

    def __init__(self, min_workers: int, records: list[dict],
                 rows_in_rounds: Callable[[int, int], int]) -> None:
        """`records`: the fit's failure records, appended to (they outlive a coordinator);
        `rows_in_rounds(a, b)`: the rows one worker trains on in rounds a..b-1 (indices)."""
        self.min_workers = min_workers
        self.records = records
        self._rows_in_rounds = rows_in_rounds
        self.joining: dict[int, tuple[Connection, msg.WorkerHello]] = {}
        self._away: dict[int, tuple[dict, int, float]] = {}
        """Per absent rank: its open record, the first round index it missed, when it left."""
        self.ended = False
        """The last round's average is out: a task that connects now has nothing to train."""

    def offer(self, rank: int, conn: Connection, hello: msg.WorkerHello,
              live: bool) -> str | None:
        """A worker connected after the start: it waits for the next round boundary. Returns
        why it is refused instead, if it is: a second live claimant of its rank, or too late."""
        if self.ended:
            return "the fit has ended: its last average is out"
        if live or rank in self.joining:
            return (f"worker rank {rank} is connected already: a second live claimant of "
                    "its rank")
        self.joining[rank] = (conn, hello)
        return None

    def lost(self, rank: int, hello: msg.WorkerHello, round_index: int, pushed: bool,
             why: str) -> None:
        """Rank `rank` left during round `round_index` (`pushed`: after its push was
        averaged, so it missed only the rounds after)."""
        record = {"partition": rank, "attempt": hello.attempt, "host": hello.host,
                  "error": why, "round_lost": round_index + 1, "round_back": None,
                  "attempt_back": None, "seconds_away": None, "skipped_rows": None,
                  "restart_at": None}
        self.records.append(record)
        self._away[rank] = (record, round_index + 1 if pushed else round_index,
                            time.monotonic())

    def absent_from_start(self, rank: int, round_index: int) -> None:
        """Rank `rank` had not connected when training started at `round_index` (counted from
        0; the record counts as the history does, from 1)."""
        record = {"partition": rank, "attempt": None, "host": None,
                  "error": "not connected when training started",
                  "round_lost": round_index + 1, "round_back": None, "attempt_back": None,
                  "seconds_away": None, "skipped_rows": None, "restart_at": None}
        self.records.append(record)
        self._away[rank] = (record, round_index, time.monotonic())

    def returned(self, rank: int, hello: msg.WorkerHello, round_index: int) -> None:
        """Rank `rank` trains again from round `round_index`: its record is closed."""
        if rank not in self._away:
            return
        record, missed_from, left = self._away.pop(rank)
        record.update(round_back=round_index + 1, attempt_back=hello.attempt,
                      seconds_away=time.monotonic() - left,
                      skipped_rows=self._rows_in_rounds(missed_from, round_index))

    def ever_away(self) -> set[int]:
        """The ranks that have missed rounds: lost, or late from the start."""
        return {record["partition"] for record in self.records}

    def close_open(self, rounds: int) -> None:
        """At the fit's end: the rows of workers that never came back, up to `rounds`."""
        for rank, (record, missed_from, _) in list(self._away.items()):
            record["skipped_rows"] = self._rows_in_rounds(missed_from, rounds)
            del self._away[rank]


def carried_states(states: dict, earlier: list | None, num_workers: int) -> list:
    """A checkpoint's worker states, by rank: those present now (`states`), and for each
    absent worker its state of the checkpoint before (`earlier`) without its compression
    residual. That residual may have been sent since, in a round it trained before leaving;
    restored, it would be sent twice. A worker that returns in a live fit starts with none
    too. With no checkpoint before (None), an absent worker's state is empty: restarted from
    this checkpoint it starts as a returning worker joins, with a fresh optimizer."""
    from sparkdl_avg.averaging.compression import RESIDUAL
    from sparkdl_avg.task.worker_state import pack_entries, unpack

    def without_residual(state: tuple) -> tuple:
        layout, payload = state
        if not any(int(entry[0]) == RESIDUAL for entry in layout):
            return state
        entries = unpack(layout, payload)
        del entries[RESIDUAL]
        return pack_entries(sorted(entries.items()))

    empty = ([], np.zeros(0, np.uint8))
    return [states[rank] if rank in states else
            empty if earlier is None else without_residual(earlier[rank])
            for rank in range(num_workers)]
