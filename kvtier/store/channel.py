"""How the verifier's decisions reach the daemon: files in `<store>/decisions/`, applied by one daemon thread.

Files, not a lock and not a connection, because the sender may be stopped (SIGSTOP, a cgroup freeze, a
debugger) at any moment and the daemon must never wait on it: a request is written under a dot-name and renamed
into place whole, so the daemon sees a request completely or not at all; a sender stopped half way leaves a
dot-file the daemon ignores (and removes once its writer is gone). The daemon answers each request with a reply
file renamed into place the same way, and removes the request.

Whether a daemon applies decisions is read from the thing itself: the daemon's applier holds a POSIX write lock
on `decisions/applier.lock` for as long as it runs, and a sender asks the kernel who holds it (F_GETLK), which
takes no lock itself, so no probe can delay the daemon either.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.store.decisions import Decision, Reply, decode_decision, decode_reply, encode
from kvtier.store.errors import StoreError
from kvtier.store.gil import applying
from kvtier.store.io import lock_holder, replace_whole

log = logging.getLogger(__name__)

SPOOL_DIR = "decisions"
APPLIER_LOCK = "applier.lock"
POLL_S = 0.005  # how often the applier looks for requests, and a sender for its reply (at most)
REPLY_TIMEOUT_S = 30.0
PROBE_S = 1.0  # while waiting for a reply, how often a sender asks whether an applier still holds the lock
STOP_GRACE_S = 2.0  # how long a stopping sender still waits for a reply (to its last decision), then none at all


class DaemonUnavailable(StoreError):
    """A decision was sent and no daemon answered it (the daemon stopped, or is not applying decisions)."""


_NO_APPLIER = (
    "the kvtier daemon stopped applying the verifier's decisions: the verifier retries; restart it to run without "
    "a daemon"
)


def spool_dir(root: str) -> str:
    return os.path.join(root, SPOOL_DIR)


def applier_pid(root: str) -> int | None:
    """The pid of the daemon applying decisions for the store at `root`, or None. Takes no lock (F_GETLK)."""
    try:
        fd = os.open(os.path.join(spool_dir(root), APPLIER_LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return lock_holder(fd)
    finally:
        os.close(fd)


class SenderStopping(DaemonUnavailable):
    """The sender is stopping (its stop event is set): the decision was not sent, or its reply no longer waited for."""


class DecisionClient:
    """The verifier's side: send a decision and wait for the daemon's reply (bounded by `timeout_s`).

    The wait ends early, with `DaemonUnavailable`, when no other process holds the applier's lock (probed every
    `PROBE_S` while waiting), and with `SenderStopping` once `stop` is set: a send already waiting then gets
    `stop_grace_s` more for its reply (the last decision of a stopping verifier), and every later send is
    refused at once, so a stopping sender ends within that grace whatever the daemon does. A send that found no
    applier, or that the daemon left unanswered for `timeout_s` (its lock held, its applier thread gone or
    stuck), makes the next sends fail at once for another `timeout_s`: a sender must not pile requests up behind
    a dead applier and wait the whole timeout for each.

    The probe asks the kernel (F_GETLK), which never reports a lock of the asking process itself: an applier in
    the sender's own process (tests, a bench playing the daemon) is not seen by it, and only its replies count."""

    def __init__(
        self,
        root: str,
        *,
        timeout_s: float = REPLY_TIMEOUT_S,
        stop: threading.Event | None = None,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.root = root
        self.dir = spool_dir(root)
        self.timeout_s = timeout_s
        self.stop = stop
        self.stop_grace_s = stop_grace_s
        self._seq = 0
        self._lock = threading.Lock()
        self._stopping_at: float | None = None  # when this client first saw `stop` set
        self._unanswered_until = 0.0  # after a send timed out: refuse to send until then
        self.sent = 0

    def daemon(self) -> int | None:
        return applier_pid(self.root)

    def _deadline(self, deadline: float, now: float) -> float:
        """`deadline`, brought forward to the stop grace's end once `stop` is set."""
        if self.stop is None or not self.stop.is_set():
            return deadline
        if self._stopping_at is None:
            self._stopping_at = now
        return min(deadline, self._stopping_at + self.stop_grace_s)

    def send(self, decision: Decision) -> Any:
        now = time.monotonic()
        if self._deadline(now + self.timeout_s, now) <= now:
            raise SenderStopping("the verifier is stopping: its decision was not sent (the daemon applies none now)")
        if now < self._unanswered_until:
            raise DaemonUnavailable(
                f"the kvtier daemon left a decision unanswered for {self.timeout_s:g}s: not sending more until "
                f"{self._unanswered_until - now:.0f}s from now; check `kvtier status`"
            )
        with self._lock:
            self._seq += 1
            name = f"{os.getpid()}-{self._seq:012d}"
        request = os.path.join(self.dir, name + ".req")
        replace_whole(request, os.path.join(self.dir, f".{name}"), encode(decision))
        raw = self._wait_reply(os.path.join(self.dir, name + ".rep"), request)
        reply = decode_reply(raw)
        self.sent += 1
        if reply.error:
            raise StoreError(f"the daemon could not apply the verifier's decision: {reply.error}")
        return reply.value

    def _wait_reply(self, reply_path: str, request: str) -> bytes:
        """The reply's bytes (the reply file removed), or a typed error with the request taken back."""
        start = time.monotonic()
        deadline = start + self.timeout_s
        wait = 0.0005
        next_probe = start + PROBE_S
        while True:
            try:
                with open(reply_path, "rb") as f:
                    raw = f.read()
                _unlink(reply_path)
                return raw
            except FileNotFoundError:
                pass
            now = time.monotonic()
            if now >= next_probe:  # a daemon that went away will not answer: say so now, not at the deadline
                next_probe = now + PROBE_S
                if self.daemon() is None:
                    _unlink(request)
                    self._unanswered_until = now + self.timeout_s
                    raise DaemonUnavailable(_NO_APPLIER)
            if now >= self._deadline(deadline, now):
                _unlink(request)
                if self._stopping_at is not None:
                    raise SenderStopping("the verifier is stopping: it no longer waits for the daemon's reply")
                self._unanswered_until = now + self.timeout_s
                raise DaemonUnavailable(
                    f"the kvtier daemon did not apply a decision within {self.timeout_s:g}s: check `kvtier status`"
                )
            # a poll for the reply file (nothing else to wait on across processes), cut short by a stop
            if self.stop is not None and not self.stop.is_set():
                self.stop.wait(wait)
            else:
                time.sleep(wait)
            wait = min(wait * 2, POLL_S)


class DecisionServer:
    """The daemon's side: one thread applies every decision, the verifier's (from files) and the daemon's own
    posted ones (`post`: the main loop's documents, which it never writes itself), each in its own short write
    transaction; the thread is the only one that waits for the index's write lock on their behalf."""

    def __init__(self, root: str, apply: Callable[[Decision], Any]) -> None:
        self.dir = spool_dir(root)
        self._apply = apply
        self._posted: collections.deque[Decision] = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_fd = -1
        self.applied = 0
        self.failed = 0

    def start(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        fd = os.open(os.path.join(self.dir, APPLIER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the writer lock already makes us the only daemon
        except OSError:
            os.close(fd)
            raise StoreError(f"{self.dir}/{APPLIER_LOCK} is held by another process: stop the other daemon") from None
        self._lock_fd = fd
        self._clean()
        self._thread = threading.Thread(target=self._run, name="kvtier-decisions", daemon=True)
        self._thread.start()

    def post(self, decision: Decision) -> None:
        """Apply `decision` on the applier thread, soon; returns at once (never waits for the index)."""
        self._posted.append(decision)
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        with applying():  # its loops over a decision's items yield the GIL to the process's load threads
            self._serve_until_stopped()

    def _serve_until_stopped(self) -> None:
        last_clean = time.monotonic()
        while not self._stop.is_set():
            worked = False
            while self._posted:
                self._apply_one(self._posted.popleft())
                worked = True
            try:
                for name in sorted(n for n in os.listdir(self.dir) if n.endswith(".req")):
                    self._serve(name)
                    os.sched_yield()  # between decisions, the GIL to the process's load threads (kvtier.store.gil)
                    worked = True
                if time.monotonic() - last_clean > 60.0:
                    self._clean()
                    last_clean = time.monotonic()
            except OSError as exc:  # a full disk, the directory removed: the senders time out; try again soon
                log.error("cannot serve the verifier's decisions in %s: %s", self.dir, exc)
                worked = False
                self._stop.wait(1.0)
            if not worked:
                self._wake.wait(POLL_S)
                self._wake.clear()

    def _apply_one(self, decision: Decision) -> Reply:
        try:
            value = self._apply(decision)
        except Exception as exc:  # a decision that fails is answered with why, and the thread goes on
            self.failed += 1
            log.exception("could not apply the verifier's %s decision", type(decision).__name__)
            return Reply(error=f"{type(exc).__name__}: {exc}")
        self.applied += 1
        return Reply(value)

    def _serve(self, name: str) -> None:
        path = os.path.join(self.dir, name)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:  # its sender gave up and took it back
            return
        try:
            reply = self._apply_one(decode_decision(raw))
        except Exception as exc:  # an unreadable request: answer it, never die of it
            reply = Reply(error=f"unreadable decision: {exc}")
        stem = name[: -len(".req")]
        replace_whole(os.path.join(self.dir, stem + ".rep"), os.path.join(self.dir, f".{stem}.rep"), encode(reply))
        _unlink(path)

    def _clean(self) -> None:
        """Remove what senders that are gone left behind: half-written requests, unread replies."""
        for name in os.listdir(self.dir):
            if name == APPLIER_LOCK:
                continue
            pid = _sender_pid(name)
            if pid is None or not _alive(pid):
                _unlink(os.path.join(self.dir, name))

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        while self._posted:  # what the main loop posted last (its documents) is still written
            self._apply_one(self._posted.popleft())
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _sender_pid(name: str) -> int | None:
    try:
        return int(name.lstrip(".").split("-", 1)[0])
    except ValueError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
