"""The daemon's life: start, READY, serve, watchdog, SIGHUP reload, SIGTERM drain + flush + exit 0.

The socket listens and serves the store (engines' tier ops, status, metrics) before torch is imported and
before the pools are allocated: both happen behind it on a thread of their own (kvtier.daemon.pool_start), and
the supervised verifier is started behind it too, so a restarted daemon answers engines' lookups without
waiting for any of them. READY=1 (what
systemd and the tests wait for) still means everything is up: it comes once the pools are ready (at once
with no profiles). Until then status says "starting" (exit 5); pools that fail to allocate stop the daemon
(exit 1, the reason logged).

The main thread runs a selector over the listening socket and a self-pipe that the signal handlers
write to; it is also the only thread that pings the systemd watchdog, so a wedged main loop or an
unhealthy backend stops the pings and systemd restarts the service. Started with `KVTIER_PARENT_PID` set (by
`kvtier demo`, by the benchmarks) it drains and exits when the process that started it dies, however that dies
(`kvtier.core.parent`).
"""

from __future__ import annotations

import gc
import logging
import os
import selectors
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from kvtier import __version__
from kvtier.core.config import DaemonConfig, apply_reloadable, load_config
from kvtier.core.errors import KvtierError
from kvtier.core.parent import end_with_parent
from kvtier.daemon.metrics import Metrics
from kvtier.daemon.sdnotify import Notifier
from kvtier.daemon.server import SocketServer
from kvtier.daemon.session import Backend
from kvtier.daemon.startup_phases import PHASES
from kvtier.daemon.supervisor import Supervisor
from kvtier.wire.stats import DaemonInfo, Reloadable, StatsDoc

log = logging.getLogger(__name__)
TICK_S = 1.0


class ServiceBackend(Backend, Protocol):
    """The backend's side of the daemon's life cycle."""

    def stats_doc(self) -> StatsDoc: ...
    def health(self) -> tuple[bool, str]: ...
    def degraded(self) -> str: ...
    def verifier_heartbeat_age(self, pid: int) -> float | None: ...
    def tick(self) -> None: ...
    def reload(self, cfg: DaemonConfig) -> None: ...
    def drain(self, timeout_s: float) -> bool: ...
    def close(self) -> None: ...
    def start_pools(self, on_change: Callable[[], None]) -> None: ...
    def pools_state(self) -> str: ...


def default_verifier_command(cfg: DaemonConfig, config_path: str | Path | None = None) -> list[str]:
    """How a supervised verifier is started: by command, as its own process (this interpreter, `kvtier verifier
    run`), on the store root and with our config for its rates; the daemon never imports the verifier."""
    cmd = [sys.executable, "-m", "kvtier.cli", "verifier", "run", "--store", str(cfg.store.root)]
    return [*cmd, "--config", str(config_path)] if config_path is not None else cmd


class Daemon:
    """One `kvtier serve` process."""

    def __init__(
        self,
        cfg: DaemonConfig,
        backend: ServiceBackend,
        *,
        config_path: str | Path | None = None,
        verifier_command: list[str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend = backend
        self.config_path = config_path
        self.notifier = Notifier()
        self.metrics = Metrics(self.stats_doc)
        self.started = time.time()
        self.server = SocketServer(cfg.server, backend, self.stats_doc, on_request=self.metrics.observe_request)
        self.supervisor: Supervisor | None = None
        if cfg.verifier.mode == "supervise":
            self.supervisor = Supervisor(
                "verifier",
                verifier_command or default_verifier_command(cfg, config_path),
                backoff_s=cfg.verifier.restart_backoff_s,
                max_backoff_s=cfg.verifier.max_backoff_s,
                heartbeat_age=backend.verifier_heartbeat_age,
                hung_after_s=cfg.verifier.hung_after_s,
            )
        self.metrics_address: tuple[str, int] | None = None
        self._stop = False
        self._pipe_r, self._pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._wake_lock = threading.Lock()  # the pool thread may outlive run(): it never writes to a closed fd
        self._pending: list[int] = []
        self._pools_seen = ""
        self._exit = 0  # non-zero: why the daemon stopped itself

    # -- stats --------------------------------------------------------------------------------------

    def _supervision(self) -> dict[str, Any]:
        """The supervisor's view of the verifier, laid over what the verifier published."""
        mode = self.cfg.verifier.mode
        if self.supervisor is None:
            state = "external (its own unit)" if mode == "external" else "not running"
            return {"mode": mode, "state": state, "restarts": 0}
        st = self.supervisor.state()
        return {"mode": mode, "state": st.state, "pid": st.pid, "restarts": st.restarts, "last_exit": st.last_exit}

    def readiness(self) -> tuple[bool, str]:
        """Serving health plus the pools' and the supervised verifier's state (a verifier down degrades, it never
        stops serving)."""
        healthy, why = self.backend.health()
        pools = self.backend.pools_state()
        if healthy and pools.startswith("failed"):
            return False, f"pools {pools}"
        if healthy and (problem := self.backend.degraded()):
            return False, problem
        if healthy and self.supervisor is not None:
            st = self.supervisor.state()
            if st.state == "backoff":
                return False, f"the verifier exited ({st.last_exit}) and waits to restart ({st.restarts} restarts)"
        return healthy, why

    def stats_doc(self) -> StatsDoc:
        doc = self.backend.stats_doc()
        healthy, why = self.readiness()
        pools = self.backend.pools_state()
        health = "ok" if healthy else f"degraded: {why}"
        if healthy and pools in ("waiting", "allocating"):
            health = "starting: allocating the pools (engine tier ops and status are served; an attach waits)"
        doc.daemon = DaemonInfo(
            version=__version__,
            pid=os.getpid(),
            uptime_s=round(time.time() - self.started, 3),
            health=health,
            config_source=self.cfg.source,
            socket=str(self.cfg.server.socket),
            connections=self.server.connections,
            metrics=f"{self.metrics_address[0]}:{self.metrics_address[1]}" if self.metrics_address else "",
            pools=pools,
            startup=PHASES.snapshot(),
        )
        doc.verifier = msgspec.structs.replace(doc.verifier, **self._supervision())
        c = self.cfg
        doc.reloadable = Reloadable(
            store_budget_bytes=c.store.budget_bytes,
            store_quota_bytes=dict(c.store.quota_bytes),
            verifier_rate_bytes_per_s=c.verifier.rate_bytes_per_s,
            verifier_sweep_interval_s=c.verifier.sweep_interval_s,
        )
        return doc

    # -- signals ------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._pending.append(signum)
        try:
            os.write(self._pipe_w, b"\0")
        except BlockingIOError:
            pass

    def _wake(self) -> None:
        """The pool thread's word that its state changed: the main loop wakes (the self-pipe) and sends READY or
        stops. A wake-up, not a poll: a loop waking every few milliseconds would take the GIL from the thread
        importing torch, over and over, and slow the start it waits for."""
        with self._wake_lock:
            if self._pipe_w < 0:  # run() has ended
                return
            try:
                os.write(self._pipe_w, b"\0")
            except BlockingIOError:  # full: the loop has wake-ups enough waiting
                pass

    def _install_signals(self) -> dict[int, Any]:
        return {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

    def _handle_signals(self) -> None:
        try:
            while os.read(self._pipe_r, 4096):
                pass
        except BlockingIOError:
            pass
        pending, self._pending = self._pending, []
        for signum in pending:
            if signum == signal.SIGHUP:
                self.reload()
            else:
                log.info("%s: shutting down", signal.Signals(signum).name)
                self._stop = True

    def reload(self) -> None:
        """SIGHUP: re-read the config; apply the store's budget and quotas, and the verifier's rates (by SIGHUP)."""
        self.notifier.reloading()
        try:
            fresh = load_config(self.config_path, mode=self.cfg.mode)  # the mode it started in, whatever chose it
            self.cfg = apply_reloadable(self.cfg, fresh)
            self.backend.reload(self.cfg)
        except KvtierError as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            self._ready_again(f"reload failed: {exc}")
            return
        if self.supervisor is not None:
            self.supervisor.signal(signal.SIGHUP)
        log.info("reloaded quotas and rates from %s", self.cfg.source)
        self._ready_again("serving (reloaded)")

    def _ready_again(self, status: str) -> None:
        """After RELOADING=1: READY=1 again, unless the start's READY has not come yet (the pools still allocate)."""
        if self._pools_settled():
            self.notifier.notify("READY=1", f"STATUS={status}")
        else:
            self.notifier.status(f"{status}; allocating pools")

    # -- main loop ----------------------------------------------------------------------------------

    def _pools_settled(self) -> bool:
        return self._pools_seen in ("ready", "none") or self._pools_seen.startswith("failed")

    def _watch_pools(self) -> None:
        """READY=1 once the pools are ready (or there are none); pools that failed stop the daemon."""
        state = self.backend.pools_state()
        if state == self._pools_seen:
            return
        self._pools_seen = state
        if state in ("ready", "none"):
            _quiet_gc()  # after serving began: what the start built (pools included) lives as long as the daemon
            self.notifier.ready(f"serving on {self.cfg.server.socket}")
            log.info("ready: %s", "pools allocated" if state == "ready" else "no profiles, no pools")
        elif state.startswith("failed"):
            log.error("stopping: the pools %s", state)
            self._exit = 1
            self._stop = True

    def _housekeeping(self) -> None:
        self.backend.tick()
        if self.supervisor is not None:
            self.supervisor.poll()
        self.metrics.connections.set(self.server.connections)
        healthy, why = self.backend.health()
        if healthy:
            self.notifier.ping_watchdog()
        else:
            log.warning("unhealthy, withholding the watchdog ping: %s", why)

    def run(self, on_ready: Callable[[str], None] | None = None) -> int:
        """Serve until SIGTERM / SIGINT; returns the exit code (0 after a clean drain). `on_ready` hears one line
        saying where it listens, once it does."""
        previous = self._install_signals()
        end_with_parent(signal.SIGTERM)  # started by a demo or a benchmark: drain and exit if it dies (no-op else)
        sel = selectors.DefaultSelector()
        sel.register(self.server.listener, selectors.EVENT_READ, "accept")
        sel.register(self.server.lobby, selectors.EVENT_READ, "greet")
        sel.register(self._pipe_r, selectors.EVENT_READ, "signal")
        try:
            if self.cfg.metrics.address:
                self.metrics_address = self.metrics.serve(self.cfg.metrics.address)
            log.info("serving on %s (%s)", self.cfg.server.socket, self.cfg.source)
            if on_ready is not None:  # before READY: whoever waits for READY finds the line written
                metrics = "http://{}:{}/metrics".format(*self.metrics_address) if self.metrics_address else "off"
                on_ready(
                    f"listening on {self.cfg.server.socket} (pid {os.getpid()}); metrics {metrics}; "
                    f"verifier {self.cfg.verifier.mode}"
                )
            PHASES.mark("listening")
            if self.backend.pools_state() != "none":
                self.notifier.status(f"serving the store on {self.cfg.server.socket}; allocating pools")
            self.notifier.ping_watchdog()
            # behind serving: neither the pools nor the verifier is needed to answer the store's lookups
            self.backend.start_pools(self._wake)
            if self.supervisor is not None:
                self.supervisor.start()
                PHASES.mark("verifier_started")
            self._watch_pools()
            last_tick = 0.0
            while not self._stop:
                # the lobby's due time from the clock now, not the turn's start: housekeeping may have run since
                dues = (TICK_S, self.notifier.watchdog_due(), self.server.lobby.due(time.monotonic()))
                wait = min(x for x in dues if x is not None)
                for key, _ in sel.select(wait):
                    if key.data == "accept":
                        self.server.accept_ready()
                    elif key.data == "greet":
                        self.server.greet_ready()
                    else:
                        self._handle_signals()
                self._watch_pools()
                now = time.monotonic()
                self.server.expire_silent(now)
                if now - last_tick >= TICK_S or (self.notifier.watchdog_due(now) == 0.0):
                    self._housekeeping()
                    last_tick = now
            return self._shutdown(sel)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            sel.close()
            with self._wake_lock:
                os.close(self._pipe_r)
                os.close(self._pipe_w)
                self._pipe_w = -1
            self.notifier.close()

    def _shutdown(self, sel: selectors.BaseSelector) -> int:
        """Stop accepting, finish in-flight requests, persist every acknowledged write, stop the verifier."""
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        self.notifier.stopping("draining connections")
        sel.unregister(self.server.listener)
        sel.unregister(self.server.lobby)  # drain closes what waits there
        self.server.stop_accepting()
        clean = self.server.drain(deadline, tick=self.notifier.ping_watchdog)
        self.notifier.status("flushing acknowledged writes to the store")
        flushed = self.backend.drain(max(0.0, deadline - time.monotonic()))
        if self.supervisor is not None:
            self.supervisor.stop(max(1.0, deadline - time.monotonic()))
        self.metrics.close()
        self.backend.close()
        if not flushed:
            log.error("shutdown deadline passed with acknowledged writes not yet in the store")
            return 1
        if not clean:
            log.warning("some connections were still busy at the deadline")
        if self._exit:
            return self._exit
        log.info("stopped cleanly")
        return 0


def _quiet_gc() -> None:
    """Keep the cyclic GC's full passes out of requests. A full pass walks every object the daemon holds and
    lands inside whichever request allocated last: inside a restore's load (ref-tiny, after a few earlier
    restores) one pass took longer than the whole load without it. What startup built (imports, pools, runtimes)
    lives as long as the daemon: freeze it out of the passes; and the load path allocates a few objects per
    object loaded, so collect the young generation every 50,000 allocations (not 700) and the old ones rarely.
    The daemon's objects rarely form cycles (its per-request records are freed by reference counting)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
