"""The verifier's signal handlers never take a lock the interrupted main thread may hold.

A handler runs on the main thread between two bytecodes. Found in a bench run: a verifier ignored SIGTERM for good,
its main thread inside the handler, waiting on the lock of the Event it was setting, which the same thread held in
`Event.wait` when the signal came. Here the main thread holds that lock when the signal arrives, in a subprocess (a
handler that deadlocks would hang the test's own process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import os, signal, threading
from kvtier.verifier.process import off_handler
stop = threading.Event()
signal.signal(signal.SIGTERM, {handler})
with stop._cond:  # where Event.wait holds it
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, on this thread
    held = True
print("set" if stop.wait(10) else "not set")
"""


@pytest.mark.parametrize(
    ("handler", "expect"),
    [("off_handler(stop.set)", "set"), ("lambda *_: stop.set()", None)],
    ids=["off_handler", "plain_set_deadlocks"],
)
def test_a_signal_while_the_main_thread_holds_the_events_lock(handler: str, expect: str | None) -> None:
    try:
        res = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(handler=handler)],
            capture_output=True,
            text=True,
            timeout=20 if expect else 4,  # (a deadlock is at once; the control case need not wait long for it)
        )
    except subprocess.TimeoutExpired:
        assert expect is None, "the handler deadlocked"
        return
    assert expect is not None, f"a plain Event.set in the handler did not deadlock: {res.stdout} {res.stderr}"
    assert res.returncode == 0 and res.stdout.strip() == expect, res.stderr
