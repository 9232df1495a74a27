"""Every wait of a fit, resolved from a TrainConfig's timeouts (`TrainConfig.waits`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Waits:
    """Every wait of a fit, in seconds, resolved from a TrainConfig (`TrainConfig.waits`)."""

    round: float
    """The driver's (sync) or the server's (async) wait for a worker's next message."""
    connect: float
    """Workers loading their partitions and connecting."""
    reply: float
    """A worker's (and the async driver's) wait for the coordinator's or server's reply."""
    finish: float
    """The training job ending after the last round (or the last push)."""
    reconnect: float
    """Async: a worker reconnecting to a parameter server being restarted."""


def waits_of(config) -> Waits:
    """Every wait of `config`'s fit, the unset ones derived from round_timeout."""
    rt = config.round_timeout
    connect = config.connect_timeout if config.connect_timeout is not None else max(300.0, rt)
    if config.reply_timeout is not None:
        reply = config.reply_timeout
    else:
        reply = 2 * rt + 30 if config.mode == "sync" else max(rt, connect)
    if config.finish_timeout is not None:
        finish = config.finish_timeout
    else:  # elastic: a retried task still loading must get to connect and be told it ended
        finish = rt if config.min_workers is None else max(rt, connect)
    return Waits(round=rt, connect=connect, reply=reply, finish=finish,
                 reconnect=config.reconnect_timeout if config.reconnect_timeout is not None
                 else rt)
