"""Supervise a helper (the verifier) as its own process: spawned by exec, restarted with exponential backoff.

The child is started with `subprocess.Popen` (fork + immediate exec, nothing of ours runs in it),
so it never inherits an open LMDB environment or cuFile handle; it gets its own session so a
terminal's signals reach it only through us. `poll()` is called from the daemon's main loop (the thread
that spawns the child must be the long-lived one: the child's parent-death signal follows that thread).

A child that runs but stopped making progress (its published heartbeat older than `hung_after_s`, e.g.
stuck in a lock wait, or stopped) is killed and restarted like one that exited. A child whose heartbeat is old
but which is running (its CPU time grew by `CPU_BUSY_S` in the last `CPU_WINDOW_S`: a stopped one's does not) is
starved, not hung: the verifier runs at the lowest priority, and beside CPUs busy at normal priority one step of it
(a maintenance pass) may take longer than `hung_after_s`; killing it then would restart it from its start for
ever, and the store would never be evicted or compacted. Past `STARVED_LIMIT` times `hung_after_s` it is killed
whatever its CPU (a child spinning in a loop that never publishes).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence

from kvtier.core.parent import tied_env

log = logging.getLogger(__name__)

STABLE_AFTER_S = 60.0  # a child that ran this long resets the backoff
CPU_WINDOW_S = 10.0  # a child whose heartbeat is old but whose CPU time grew within this long ...
CPU_BUSY_S = 0.02  # ... by at least this much (more than its idle threads' wake-ups ever add up to) is starved
CPU_SAMPLE_S = 0.5  # the child's CPU time is sampled at most this often
STARVED_LIMIT = 10.0  # a heartbeat older than this many hung_after_s is a hang, whatever the CPU
_TICK = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(slots=True)
class SupervisorState:
    state: str  # starting | running | backoff | stopped
    pid: int | None
    restarts: int
    last_exit: int | None
    next_start_in_s: float | None


class Supervisor:
    """Keeps one command running; restarts after exits with backoff doubling from `backoff_s` to `max_backoff_s`."""

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        *,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        heartbeat_age: Callable[[int], float | None] | None = None,
        hung_after_s: float = 120.0,
    ) -> None:
        """`heartbeat_age(pid)`: seconds since the child with that pid last published progress (None: never)."""
        self.name = name
        self.heartbeat_age = heartbeat_age
        self.hung_after_s = hung_after_s
        self.hung_kills = 0
        self.command = list(command)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_at = 0.0
        self._next_start: float | None = None
        self._delay = backoff_s
        self._stopped = False
        self.restarts = 0
        self.last_exit: int | None = None
        self.starved_spared = 0  # times an old heartbeat was forgiven because the child was using CPU
        self._cpu: collections.deque[tuple[float, float]] = collections.deque()  # (monotonic, CPU s) of the child
        self._spared_this_child = False

    def start(self) -> None:
        self._stopped = False
        self._spawn()

    def _spawn(self) -> None:
        try:
            env = tied_env(os.environ)  # it ends if we die, however (`kvtier.core.parent`)
            self._proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True, env=env
            )
        except OSError as exc:
            log.error("%s: cannot start %s: %s", self.name, self.command[0], exc)
            self._proc = None
            self.last_exit = -1
            self._schedule()
            return
        self._started_at = time.monotonic()
        self._next_start = None
        self._cpu.clear()
        self._spared_this_child = False
        log.info("%s started (pid %d)", self.name, self._proc.pid)

    def _schedule(self) -> None:
        self._next_start = time.monotonic() + self._delay
        log.warning("%s exited (%s); restarting in %.1fs", self.name, self.last_exit, self._delay)
        self._delay = min(self._delay * 2, self.max_backoff_s)

    def poll(self) -> None:
        """Reap an exited child and restart it when its backoff has passed."""
        if self._stopped:
            return
        now = time.monotonic()
        if self._proc is not None:
            code = self._proc.poll()
            if code is None:
                self._sample_cpu(self._proc.pid, now)
            if code is None and self._hung(now):
                self._proc.kill()
                code = self._proc.wait()
            if code is None:
                if now - self._started_at >= STABLE_AFTER_S:
                    self._delay = self.backoff_s
                return
            self.last_exit = code
            self._proc = None
            if now - self._started_at >= STABLE_AFTER_S:
                self._delay = self.backoff_s
            self._schedule()
        if self._next_start is not None and now >= self._next_start:
            self.restarts += 1
            self._spawn()

    def _hung(self, now: float) -> bool:
        """Whether the running child's heartbeat (or, before its first one, its start) is too old."""
        if self.heartbeat_age is None or self._proc is None or now - self._started_at < self.hung_after_s:
            return False
        try:
            age = self.heartbeat_age(self._proc.pid)
        except Exception:  # an unreadable status is not evidence of a hang
            log.exception("%s: cannot read its heartbeat", self.name)
            return False
        age = now - self._started_at if age is None else age
        if age < self.hung_after_s:
            return False
        if age < STARVED_LIMIT * self.hung_after_s and self._running(self._proc.pid, now):
            if not self._spared_this_child:
                log.warning(
                    "%s (pid %d): no heartbeat for %.0fs but using CPU: starved, not hung; left running",
                    self.name,
                    self._proc.pid,
                    age,
                )
                self._spared_this_child = True
            self.starved_spared += 1
            return False
        self.hung_kills += 1
        log.error("%s (pid %d) made no progress for %.0fs; killing it to restart", self.name, self._proc.pid, age)
        return True

    def _sample_cpu(self, pid: int, now: float) -> None:
        if self._cpu and now - self._cpu[-1][0] < CPU_SAMPLE_S:
            return
        got = _cpu_and_state(pid)
        if got is None:
            return
        self._cpu.append((now, got[0]))
        while len(self._cpu) > 1 and self._cpu[1][0] <= now - CPU_WINDOW_S:  # keep one sample a window old
            self._cpu.popleft()

    def _running(self, pid: int, now: float) -> bool:
        """Its CPU time grew by CPU_BUSY_S since the oldest sample of the last CPU_WINDOW_S (and it is no zombie)."""
        got = _cpu_and_state(pid)
        # CPU growth decides, not the state letter of the moment: a child stopped for a moment (a debugger's
        # break, a freeze between two steps) still grew; one stopped for the whole window did not
        if got is None or got[1] in "ZX" or not self._cpu:
            return False
        return got[0] - self._cpu[0][1] >= CPU_BUSY_S

    def signal(self, signum: int) -> None:
        """Forward a signal (SIGHUP: reload rates) to the running child."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signum)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit code (None if it was not running)."""
        self._stopped = True
        self._next_start = None
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", self.name, timeout_s)
                proc.kill()
                proc.wait()
        self.last_exit = proc.returncode
        return proc.returncode

    def state(self) -> SupervisorState:
        now = time.monotonic()
        if self._stopped:
            state = "stopped"
        elif self._proc is not None:
            state = "running" if now - self._started_at >= 1.0 else "starting"
        else:
            state = "backoff"
        next_in = max(0.0, self._next_start - now) if self._next_start is not None else None
        return SupervisorState(state, self._proc.pid if self._proc else None, self.restarts, self.last_exit, next_in)


def _cpu_and_state(pid: int) -> tuple[float, str] | None:
    """User + system CPU seconds of every thread of `pid`, and its state letter (T: stopped); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK, fields[0]
