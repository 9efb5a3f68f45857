"""Run `kvtier demo` with a SIGINT delivered exactly while the client's heartbeat thread is being started.

    python demo_interrupt.py MODE demo [ARGS...]

The heartbeat starts inside `Client.attach()`, engine A's first call once the demo's daemon serves. Ctrl-C there
used to end the demo with exit 70 ("cannot join thread before it is started"): the KeyboardInterrupt left a
thread that had not started, and the client's close() on the way out joined it. A signal reaches that moment
only by chance on a loaded machine; here it is placed there on purpose, in one of two ways (MODE):

- `before-spawn`: the signal is raised as `Thread.start()` is entered, so no thread is ever created;
- `held`: the operating-system thread is created but held on an event this script owns (never released: the
  process exits with it parked), and the signal is raised while `start()` would wait for it to report in.

`signal.raise_signal` runs the Python handler before it returns, so the KeyboardInterrupt is raised right there,
not at some later instruction. Python's own Ctrl-C handler is put back first: a process started from a
non-interactive shell's background job inherits SIGINT ignored, and Python then leaves it ignored, so the
signal would do nothing (a terminal's Ctrl-C reaches a process that does not ignore it). The script says on
stderr that it fired, so a test can tell a run where the
moment never came (the thread renamed, say) from one that survived it.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

HEARTBEAT = "kvtier-heartbeat"
MODES = ("before-spawn", "held")
FIRED = "demo_interrupt: SIGINT raised while starting the heartbeat thread"


def _fire(mode: str) -> None:
    sys.stderr.write(f"{FIRED} ({mode})\n")
    sys.stderr.flush()
    signal.raise_signal(signal.SIGINT)


def install(mode: str) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fired = False

    if mode == "before-spawn":
        real_start = threading.Thread.start

        def start(self: threading.Thread) -> None:
            nonlocal fired
            if self.name == HEARTBEAT and not fired:
                fired = True
                _fire(mode)
            real_start(self)

        threading.Thread.start = start  # type: ignore[method-assign]
    elif mode == "held":
        real_spawn: Callable[..., Any] = threading._start_new_thread  # type: ignore[attr-defined]
        hold = threading.Event()

        def spawn(func: Callable[..., Any], args: tuple[Any, ...]) -> Any:
            nonlocal fired
            owner = getattr(func, "__self__", None)
            if isinstance(owner, threading.Thread) and owner.name == HEARTBEAT and not fired:
                fired = True

                def parked() -> None:
                    hold.wait()
                    func(*args)

                real_spawn(parked, ())
                _fire(mode)
            return real_spawn(func, args)

        threading._start_new_thread = spawn  # type: ignore[attr-defined]
    else:
        raise SystemExit(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


if __name__ == "__main__":
    install(sys.argv[1])
    from kvtier.cli.main import main

    sys.argv = ["kvtier", *sys.argv[2:]]
    main()
