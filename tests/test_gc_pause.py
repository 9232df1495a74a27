"""`collector_paused`: no automatic collection while any thread imports inside it, and the
collector's state as it was once the last one leaves."""

from __future__ import annotations

import gc
import threading

from sparkdl_avg._gc_pause import collector_paused


def test_collection_stays_off_until_the_last_thread_leaves():
    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()
    seen = []

    def importer():
        with collector_paused():
            inside.set()
            leave.wait(10)
            seen.append(gc.isenabled())

    thread = threading.Thread(target=importer)
    thread.start()
    inside.wait(10)
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread is still importing
    leave.set()
    thread.join(10)
    assert seen == [False]
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
