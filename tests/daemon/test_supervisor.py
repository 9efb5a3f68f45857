"""The verifier hook: a real child process, restarted with backoff after it exits, stopped on demand."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvtier.daemon import supervisor
from kvtier.daemon.supervisor import Supervisor
from support.procs import ended


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_restarts_with_backoff(tmp_path: Path) -> None:
    log = tmp_path / "runs"
    sup = Supervisor(
        "t",
        [sys.executable, "-c", f"open({str(log)!r}, 'a').write('x'); raise SystemExit(3)"],
        backoff_s=0.05,
        max_backoff_s=0.2,
    )
    sup.start()

    def runs() -> int:
        sup.poll()
        return len(log.read_text()) if log.exists() else 0

    _until(lambda: runs() >= 4)
    st = sup.state()
    assert st.restarts >= 3 and st.last_exit == 3
    assert st.next_start_in_s is None or st.next_start_in_s <= 0.2  # doubled, but capped
    sup.stop(1.0)
    n = runs()
    sup.poll()
    st = sup.state()
    assert runs() == n and st.state == "stopped" and st.pid is None and st.next_start_in_s is None


def test_stop_terminates_and_hup_is_forwarded(tmp_path: Path) -> None:
    flag = tmp_path / "hup"
    code = (
        "import signal, sys, time, pathlib\n"
        f"signal.signal(signal.SIGHUP, lambda *a: pathlib.Path({str(flag)!r}).write_text('hup'))\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
        f"pathlib.Path({str(flag)!r} + '.ready').write_text('1')\n"
        "while True: time.sleep(0.05)\n"
    )
    sup = Supervisor("t", [sys.executable, "-c", code])
    sup.start()
    _until(lambda: Path(str(flag) + ".ready").exists())
    pid = sup.state().pid
    assert pid is not None and sup.state().state in ("starting", "running")
    sup.signal(signal.SIGHUP)
    _until(lambda: flag.exists())
    assert sup.stop(5.0) == 0
    _until(lambda: ended(pid))


def test_missing_command_backs_off_instead_of_crashing() -> None:
    sup = Supervisor("t", ["/nonexistent/kvtier-verifier"], backoff_s=10.0)
    sup.start()
    st = sup.state()
    assert st.state == "backoff" and st.pid is None and st.next_start_in_s is not None and st.next_start_in_s > 5
    sup.stop()


def test_a_child_whose_heartbeat_stops_is_killed_and_restarted(tmp_path: Path) -> None:
    """A hung child (alive, no progress: e.g. deadlocked in a lock wait) is detected by its heartbeat."""
    beats: dict[int, float] = {}
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)\n"
    sup = Supervisor("t", [sys.executable, "-c", code], backoff_s=0.05, heartbeat_age=beats.get, hung_after_s=0.5)
    sup.start()
    started = time.monotonic()
    first = sup.state().pid
    assert first is not None
    beats[first] = 0.1  # fresh: left alone
    _until(lambda: time.monotonic() - started >= 0.6)  # past hung_after_s: only the heartbeat's age decides
    sup.poll()
    assert sup.state().pid == first and sup.hung_kills == 0
    beats[first] = 5.0  # stale: it ignores SIGTERM, so it is killed
    _until(lambda: (sup.poll(), sup.state().pid not in (None, first))[1])
    assert sup.hung_kills == 1 and sup.state().last_exit == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)
    sup.stop(1.0)


def test_a_child_with_an_old_heartbeat_that_uses_cpu_is_starved_not_hung_until_the_limit(monkeypatch) -> None:
    """A low-priority verifier on busy CPUs publishes late but runs: killing it would restart its maintenance pass
    for ever. Stopped (SIGSTOP) it is hung; and past STARVED_LIMIT x hung_after_s it is hung whatever its CPU."""
    monkeypatch.setattr(supervisor, "CPU_WINDOW_S", 1.0)
    monkeypatch.setattr(supervisor, "CPU_SAMPLE_S", 0.05)
    monkeypatch.setattr(supervisor, "STARVED_LIMIT", 20.0)
    hung_after_s = 0.5
    sup = Supervisor(
        "t",
        [sys.executable, "-c", "while True: pass"],
        backoff_s=0.05,
        heartbeat_age=lambda pid: 5.0,
        hung_after_s=hung_after_s,
    )
    sup.start()
    first = sup.state().pid
    assert first is not None
    try:
        started = time.monotonic()
        while time.monotonic() - started < 2.0:  # past hung_after_s, heartbeat 5 s old, spinning: left running
            sup.poll()
            assert sup.state().pid == first and sup.hung_kills == 0
            time.sleep(0.02)  # the daemon's main loop polls at intervals too
        assert sup.starved_spared > 0
        os.kill(first, signal.SIGSTOP)  # stopped: no CPU, state T
        _until(lambda: (sup.poll(), sup.state().pid != first)[1])
        assert sup.hung_kills == 1
        _until(lambda: (sup.poll(), sup.state().pid is not None)[1])
        second = sup.state().pid
        monkeypatch.setattr(supervisor, "STARVED_LIMIT", 5.0)  # the 5 s heartbeat is now past the limit
        _until(lambda: (sup.poll(), sup.state().pid not in (None, second))[1])
        assert sup.hung_kills == 2
    finally:
        sup.stop(1.0)
