"""The connection threads: every call runs at once (none waits behind a busy one), and threads are reused."""

from __future__ import annotations

import threading
import time

from kvtier.daemon.workers import Workers


def test_calls_never_wait_for_each_other_and_threads_are_reused() -> None:
    release = threading.Event()
    running: list[threading.Event] = [threading.Event() for _ in range(12)]
    done = threading.Semaphore(0)
    names: set[str] = set()

    def call(i: int) -> None:
        names.add(threading.current_thread().name)
        running[i].set()
        release.wait(30)
        done.release()

    workers = Workers(call, "test-worker")
    for i in range(6):
        workers.submit(i)
    assert all(running[i].wait(30) for i in range(6))  # six at once, each blocked: six threads
    release.set()
    for _ in range(6):
        assert done.acquire(timeout=30)
    deadline = time.monotonic() + 30
    while workers.idle < 6:  # each marks itself idle just after its call returned
        assert time.monotonic() < deadline, workers.idle
        time.sleep(0.001)
    for i in range(6, 12):  # the same six threads take the next six calls
        workers.submit(i)
    for _ in range(6):
        assert done.acquire(timeout=30)
    assert all(e.is_set() for e in running)
    assert workers.started == 6 and len(names) == 6


def test_a_call_that_raises_costs_its_thread_not_the_next_calls() -> None:
    ran = threading.Semaphore(0)

    def call(fail: bool) -> None:
        ran.release()
        if fail:
            raise RuntimeError("a bug in a handler")

    hook, threading.excepthook = threading.excepthook, lambda args: None  # (the failure is expected here)
    try:
        workers = Workers(call, "test-worker")
        workers.submit(True)
        assert ran.acquire(timeout=30)
        workers.submit(False)
        assert ran.acquire(timeout=30)  # served: on a new thread, the failed one having ended
    finally:
        threading.excepthook = hook
