"""torch and the served profiles' pools, loaded and allocated on a thread of their own once the daemon serves.

Allocating pools is the slow part of a start (seconds for large budgets, tens of seconds for DeepSeek-V4's
defaults), and nothing but kvtier's own client needs them: engines' tier ops, status and metrics read the
store. So the daemon listens first and allocates behind it; an attach waits for the pools (they are mapped
into the client at attach), everything else is served at once. The state is read from here, never cached
elsewhere: `none` (no profiles: an engine-only node), `waiting`, `allocating`, `ready`, or `failed`.

Before it allocates, the thread runs the warm-up (`warm`: import torch and the pools' and loads' modules, take
the store's load resources), also on a node without profiles: importing torch costs seconds of CPU, more than
everything else a start does, and nothing a lookup answers needs it, so the daemon listens without it. A request
that needs a tensor (an engine tier's load or store) imports it where it needs it, which waits for the
warm-up's import if that is still under way (Python's import lock), and never imports it twice.

Two FIFOs let a test observe the daemon serving in between, without a race: `KVTIER_HOLD_TORCH` before the
warm-up, `KVTIER_HOLD_POOLS` before the allocation. The thread opens the named FIFO and reads one byte first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.core.profile import ModelProfile
from kvtier.daemon.runtime import Runtime
from kvtier.daemon.startup_phases import PHASES

log = logging.getLogger(__name__)
HOLD_ENV = "KVTIER_HOLD_POOLS"
HOLD_TORCH_ENV = "KVTIER_HOLD_TORCH"


def _hold(env: str) -> None:
    """Wait for one byte on the FIFO that `env` names (a test's hand on the start), if it names one."""
    hold = os.environ.get(env)
    if hold:
        with open(hold, "rb") as fifo:  # blocks until the test opens the other end and writes
            fifo.read(1)


class PoolStart:
    """Warm up, then build each profile's pools, on one thread; `adopt` hands them to the backend when all are
    built."""

    def __init__(
        self,
        profiles: Sequence[ModelProfile],
        build: Callable[[ModelProfile], Runtime],
        adopt: Callable[[list[Runtime]], None],
        warm: Callable[[], None] | None = None,
    ) -> None:
        self._profiles = list(profiles)
        self._build = build
        self._adopt = adopt
        self._warm = warm
        self._warmed = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._state = "none" if not self._profiles else "waiting"
        self._error = ""
        self._closing = False
        self._built: list[Runtime] = []
        self._thread: threading.Thread | None = None
        self._on_change: Callable[[], None] | None = None
        self.started_at: float | None = None
        self.seconds: float | None = None  # how long the allocation took, once ready
        if not self._profiles:
            self._done.set()

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    @property
    def error(self) -> str:
        with self._lock:
            return self._error

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def warmed(self) -> bool:
        """Whether the warm-up (torch and the pools' modules) has finished."""
        return self._warmed.is_set()

    def start(self, on_change: Callable[[], None] | None = None) -> None:
        """Begin the warm-up, then allocating (once); with no profiles, the warm-up alone. `on_change` is called
        (on the pool thread) after each change of `state` and once the thread ends."""
        if self._thread is not None or (not self._profiles and self._warm is None):
            return
        self._on_change = on_change
        self._thread = threading.Thread(target=self._run, name="kvtier-pools", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """True once allocation ended (ready, failed, or there is nothing to allocate); False if still going."""
        return self._done.wait(timeout_s)

    def _run(self) -> None:
        try:
            self._work()
        finally:
            if self._on_change is not None:
                self._on_change()

    def _work(self) -> None:
        try:
            _hold(HOLD_TORCH_ENV)
            if self._warm is not None:
                self._warm()
            PHASES.mark("torch_loaded")
        except BaseException as exc:  # without torch no load can be served: the daemon stops, saying why
            with self._lock:
                self._state = "failed"
                self._error = f"loading torch and the pools' modules: {type(exc).__name__}: {exc}"
            log.error("%s", self._error)
            self._done.set()
            return
        finally:
            self._warmed.set()
        if not self._profiles:
            return
        _hold(HOLD_ENV)
        with self._lock:
            if self._closing:
                self._state = "failed"
                self._error = "the daemon stopped before its pools were allocated"
                self._done.set()
                return
            self._state = "allocating"
            self.started_at = time.monotonic()
        if self._on_change is not None:
            self._on_change()
        try:
            for profile in self._profiles:
                if self._closing:
                    raise RuntimeError("the daemon stopped before its pools were allocated")
                self._built.append(self._build(profile))
            with self._lock:
                if self._closing:
                    raise RuntimeError("the daemon stopped before its pools were allocated")
                self._adopt(self._built)
                self._built = []
                self._state = "ready"
                self.seconds = time.monotonic() - (self.started_at or time.monotonic())
            log.info("pools ready for %s in %.2f s", ", ".join(p.name for p in self._profiles), self.seconds)
        except BaseException as exc:  # the daemon keeps serving the store; attach says why it cannot
            with self._lock:
                self._state = "failed"
                self._error = f"{type(exc).__name__}: {exc}"
            if not self._closing:
                log.error("allocating the pools failed: %s", self._error)
            for rt in self._built:
                rt.manager.close()
            self._built = []
        finally:
            self._done.set()

    def close(self, timeout_s: float) -> None:
        """Stop after the profile being allocated (an allocation cannot be interrupted); what was built but
        not adopted is freed here. Adopted pools are the backend's to close."""
        with self._lock:
            self._closing = True
        # A thread still loading torch has built nothing and builds nothing once it sees `_closing`: not waited
        # for (an import cannot be interrupted; on a busy node it can outlast a SIGTERM's patience). It is a
        # daemon thread, so the process exits under it.
        if self._thread is not None and self._warmed.is_set():
            self._thread.join(timeout_s)
