"""Waiting for what a server does on its own handler thread (a refusal counted, a report
recorded) just after the peer was answered: poll, with a deadline."""

from __future__ import annotations

import time


def eventually(condition, seconds: float = 5.0) -> bool:
    """Whether `condition()` held within `seconds`, polled every 20 ms."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def wait_for(condition, timeout: float = 5.0) -> None:
    """`eventually`, asserted."""
    assert eventually(condition, timeout)
