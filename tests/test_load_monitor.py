"""The driver's view of the load phase: tasks report rows loaded to an authenticated monitor;
what is not a report from one of this fit's tasks is refused, and a task never fails for
want of a monitor."""

import socket
import time

import pytest
from polling import eventually

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.driver.load_monitor import LoadMonitor
from sparkdl_avg.task.load_report import LoadReport, LoadReporter


@pytest.fixture
def monitor():
    with LoadMonitor(host="127.0.0.1", advertise="127.0.0.1", num_workers=2) as m:
        yield m


def test_reports_add_up_per_partition_and_the_newest_wins(monitor):
    a = LoadReporter(monitor.reachable_at, monitor.secret, rank=0, of=100)
    b = LoadReporter(monitor.reachable_at, monitor.secret, rank=1, of=90)
    a(10)
    b(20)
    assert eventually(lambda: monitor.progress() == (30, 2, 0))
    a(40)  # within REPORT_EVERY_S of the last: not sent
    time.sleep(0.2)
    assert monitor.progress() == (30, 2, 0)
    a(100, done=True)  # the last report always goes
    assert eventually(lambda: monitor.progress() == (120, 2, 1))
    b(90, done=True)
    assert eventually(lambda: monitor.progress() == (190, 2, 2))


def test_a_wrong_secret_or_a_rank_beyond_the_fit_is_refused(monitor):
    LoadReporter(monitor.reachable_at, b"x" * 32, rank=0, of=10)(5)
    LoadReporter(monitor.reachable_at, monitor.secret, rank=7, of=10)(5)
    assert eventually(lambda: monitor.refusals() == {"auth": 1, "unexpected": 1})
    assert monitor.progress() == (0, 0, 0)


class _Forged:
    """Stands in for a LoadReport without its checks, as a broken or hostile peer would."""

    def __init__(self, **meta) -> None:
        self.meta = meta

    def to_meta(self) -> dict:
        return self.meta


@pytest.mark.parametrize("meta", [dict(rank=0, rows=11, of=10, done=False),
                                  dict(rank=0, rows=1, of=10),
                                  dict(rank=0, rows=1, of=10, done=False, extra=1)])
def test_the_monitor_refuses_a_malformed_report_and_records_nothing(monitor, meta):
    from sparkdl_avg.net.auth import authenticate_to_server
    from sparkdl_avg.net.frames import connect

    conn = connect(monitor.reachable_at, timeout=5, max_payload=0)
    try:
        authenticate_to_server(conn, monitor.secret, _Forged(**meta))
    finally:
        conn.close()
    assert eventually(lambda: monitor.refusals() == {"malformed": 1})
    assert monitor.progress() == (0, 0, 0)


@pytest.mark.parametrize("report", [dict(rank=0, rows=11, of=10, done=False),
                                    dict(rank=-1, rows=1, of=10, done=False),
                                    dict(rank=0, rows=1, of=10, done="yes")])
def test_a_malformed_report_cannot_be_built(report):
    with pytest.raises(ProtocolError):
        LoadReport(**report)


def test_an_unreachable_monitor_costs_a_task_nothing():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once closed
    reporter = LoadReporter(("127.0.0.1", port), b"s" * 32, rank=0, of=10)
    for rows in range(5):
        reporter(rows, done=True)  # no exception, and it stops trying after a few
    assert reporter._failures == 3
    LoadReporter(None, b"", rank=0, of=10)(3)  # no monitor at all
