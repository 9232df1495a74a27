"""A client of K parameter-server shards that answers like one `PSClient`: each call goes to
every shard at once (one thread per shard; sockets release the GIL), and the parameters land
in views of one flat buffer, so a pull or a push copies nothing beyond what the wire moves.

No update is lost or applied twice when one shard restarts from an older checkpoint: the
client knows, per shard, the steps of this worker that shard has applied (from each pull,
then from each push it made). A worker rewinds to the least of them (`progress`) and redoes
its steps; a redone update goes only to the shards that lack it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import Credential
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.shards import bounds, merge_acks, merge_reports


def connect(addresses: list[tuple[str, int]], **kwargs) -> PSClient | ShardedClient:
    """One server: a plain `PSClient` (exactly what a fit without shards uses); several: a
    `ShardedClient`. `kwargs`: `PSClient`'s."""
    if len(addresses) == 1:
        return PSClient(addresses[0], **kwargs)
    return ShardedClient(addresses, **kwargs)


class ShardedClient:
    def __init__(self, addresses: list[tuple[str, int]], *, secret: bytes | Credential,
                 worker: int,
                 numel: int, dtype: np.dtype, timeout: float,
                 tls_ca_pem: str | None = None, attempt: int = 0) -> None:
        self.bounds = bounds(numel, len(addresses))
        self.params = np.empty(numel, dtype)
        self.progress = 0
        """After a pull: the local steps of this worker that every shard has applied."""
        self._progress = [0] * len(addresses)
        self._snapshot: list[int] | None = None
        self._pool = ThreadPoolExecutor(len(addresses), thread_name_prefix="ps-shard")
        self.shards: list[PSClient | None] = [None] * len(addresses)

        def open_one(k: int, _) -> None:
            lo, hi = self.bounds[k]
            self.shards[k] = PSClient(addresses[k], secret=secret, worker=worker,
                                      numel=hi - lo, dtype=dtype, timeout=timeout,
                                      tls_ca_pem=tls_ca_pem, out=self.params[lo:hi],
                                      attempt=attempt)
        try:
            self._each(open_one, range(len(addresses)))
        except BaseException:
            self.close()
            raise

    def _each(self, fn, shards=None) -> list:
        """`fn(k, client)` on the given shards (all: None) at once; their results in shard
        order. Every call ends before an error is raised (the first shard's), so no
        connection is left mid-answer."""
        shards = range(len(self.shards)) if shards is None else list(shards)
        futures = [self._pool.submit(fn, k, self.shards[k]) for k in shards]
        errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def close(self) -> None:
        for c in self.shards:
            if c is not None:
                c.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def pull(self) -> int:
        """Every shard's slice into `params`; returns the least version."""
        versions = self._each(lambda k, c: c.pull())
        self._progress = [c.progress for c in self.shards]
        self.progress = min(self._progress)
        return min(versions)

    def pull_snapshot(self) -> int | None:
        """The evaluation snapshot every shard holds for this worker, into `params`; its id
        (shard 0's), or None where some shard has none pending (then ask again later)."""
        ids = self._each(lambda k, c: c.pull_snapshot())
        self._snapshot = ids if None not in ids else None
        return None if self._snapshot is None else ids[0]

    def answer(self, request: int, result: dict, eval_s: float) -> msg.Ack:
        """This worker's evaluation of the snapshot last pulled, to every shard under that
        shard's own request id. Only shard 0's result is read (`shards.merge_reports`), so
        only shard 0 gets the metrics' statistics (a score table may be megabytes)."""
        ids = self._snapshot
        if ids is None or ids[0] != request:
            raise ValueError(f"request {request} is not the snapshot last pulled")
        sums = {k: v for k, v in result.items() if k not in ("metrics", "tables")}
        return merge_acks(self._each(
            lambda k, c: c.answer(ids[k], result if k == 0 else sums, eval_s)))

    def finished(self, wait_s: float) -> msg.Ack:
        return merge_acks(self._each(lambda k, c: c.finished(wait_s)))

    def push(self, update: np.ndarray, *, samples: int = 0, loss_sum: float = 0.0,
             steps: int | None = None, lr: float | None = None) -> msg.Ack:
        """Each shard its slice of `update`; with `steps`, only the shards that have not
        applied this worker's steps up to there (the others have it from before a shard's
        restart)."""
        todo = [k for k in range(len(self.shards))
                if steps is None or steps > self._progress[k]]

        def push_one(k: int, c: PSClient) -> msg.Ack:
            lo, hi = self.bounds[k]
            ack = c.push(update[lo:hi], samples=samples, loss_sum=loss_sum, steps=steps, lr=lr)
            if steps is not None and not ack.stop:
                self._progress[k] = steps
            return ack
        return merge_acks(self._each(push_one, todo))

    def init(self, params: np.ndarray, workers: int = 0, expect: dict | None = None,
             gradients: int | None = None) -> dict:
        """Driver only: each shard starts from its slice (and its part of the leading
        `gradients` values); returns shard 0's settings with `shards`, the number of them."""
        def init_one(k: int, c: PSClient) -> dict:
            lo, hi = self.bounds[k]
            part = None if gradients is None else min(max(gradients - lo, 0), hi - lo)
            return c.init(params[lo:hi], workers, expect, part)

        settings = self._each(init_one)
        return {**settings[0], "shards": len(self.shards)}

    def stop(self) -> dict:
        return merge_reports(self._each(lambda k, c: c.stop()))

    def stats(self) -> dict:
        return merge_reports(self._each(lambda k, c: c.stats()))

    def evaluate(self) -> dict:
        return merge_reports(self._each(lambda k, c: c.evaluate()))
