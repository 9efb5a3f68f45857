"""The applier's loops give the GIL up now and then (kvtier.store.gil), and only on the applier's thread."""

from __future__ import annotations

import threading

from kvtier.store import gil


def _yields(monkeypatch, run) -> int:
    calls: list[int] = []
    monkeypatch.setattr(gil.os, "sched_yield", lambda: calls.append(1))
    run()
    return len(calls)


def test_a_yielder_yields_on_the_applier_s_thread_only(monkeypatch) -> None:
    def loop() -> None:
        pause = gil.Yielder(every_s=0.0)
        for _ in range(10):
            pause()

    def applied() -> None:
        with gil.applying():
            loop()

    assert _yields(monkeypatch, loop) == 0  # a verifier with no daemon: never
    assert _yields(monkeypatch, applied) == 10
    other = threading.Thread(target=loop)  # the flag is the thread's own
    with gil.applying():
        assert _yields(monkeypatch, lambda: (other.start(), other.join())) == 0
    assert _yields(monkeypatch, loop) == 0  # and ends with the block


def test_a_yielder_yields_once_per_interval_of_its_own_running(monkeypatch) -> None:
    clock = iter(float(i) * 1e-4 for i in range(1000))  # each reading 0.1 ms after the last
    monkeypatch.setattr(gil.time, "perf_counter", lambda: next(clock))

    def loop() -> None:
        with gil.applying():
            pause = gil.Yielder(every_s=0.0005)
            for _ in range(40):
                pause()

    n = _yields(monkeypatch, loop)
    assert 3 <= n <= 10  # about every 0.5 ms of a loop that reads the clock every 0.1 ms: not every item
