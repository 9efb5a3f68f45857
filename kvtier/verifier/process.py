"""`kvtier verifier run`: the verifier as its own OS process (spawned by exec: never a fork of the daemon)."""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from kvtier.core.errors import KvtierError
from kvtier.core.parent import end_with_parent
from kvtier.store import INDEX_DIR, DecisionClient, DiskStore, StoreConfig, StoreError, applier_pid
from kvtier.verifier.errors import StoreNotFound
from kvtier.verifier.priority import lower_priority
from kvtier.verifier.settings import VerifierSettings, settings_from_config
from kvtier.verifier.verifier import Verifier

log = logging.getLogger(__name__)
VERIFIER_LOCK = "verifier.lock"


def store_exists(root: str | Path) -> bool:
    return os.path.isdir(os.path.join(root, INDEX_DIR))


def open_store(root: str | Path, *, readonly: bool = False, stop: threading.Event | None = None) -> DiskStore:
    """A non-writer store for maintenance or audit: O_DIRECT reads where the filesystem allows, else buffered.

    For maintenance beside a running daemon (its decision applier is live), the index is opened read-only and
    every change is sent to the daemon (`kvtier.store.decisions`): this process never holds the index's write
    lock, so stopping it at any moment delays no write of the daemon's. With no daemon it writes itself. Once
    `stop` is set, a decision's reply is waited for only briefly (`kvtier.store.channel.STOP_GRACE_S`), so a
    stopping verifier never waits on a daemon whose applier is gone."""
    if not store_exists(root):
        raise StoreNotFound(f"no kvtier store at {root} (no {INDEX_DIR}/): pass the --store the daemon uses")
    daemon = None if readonly else applier_pid(str(root))
    decisions = DecisionClient(str(root), stop=stop) if daemon is not None else None
    if decisions is not None:
        log.info("the daemon (pid %d) applies this process's index changes", daemon)
    # (its scans set up what they read through as they go: nothing taken at open, and no torch loaded for it)
    opened = functools.partial(DiskStore, str(root), readonly=readonly, decisions=decisions, take_load_resources=False)
    try:
        return opened(StoreConfig(io_backend="odirect", io_threads=1))
    except StoreError as exc:
        if "O_DIRECT" not in str(exc):
            raise
        return opened(StoreConfig(io_backend="buffered", io_threads=1))


def load_settings(config: str | Path | None, overrides: Mapping[str, Any]) -> VerifierSettings:
    """Defaults, then the daemon's config file (rates, limits, profiles), then explicit overrides."""
    base = VerifierSettings()
    if config is not None:
        base = settings_from_config(config, base)
    return dataclasses.replace(base, **overrides)


def off_handler(fn: Callable[[], object]) -> Callable[[int, FrameType | None], None]:
    """A signal handler that runs `fn` on a thread of its own. A handler runs on the main thread between two of its
    bytecodes, and the main thread may then be inside `Event.wait` of an Event that `fn` sets, holding its
    Condition's lock: setting it from there waits for a lock its own thread holds, for ever (a verifier that then
    ignored SIGTERM was found so)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=fn, name="kvtier-signal", daemon=True).start()

    return handler


def run(
    root: str | Path, config: str | Path | None, overrides: Mapping[str, Any], *, wait_for_store_s: float = 600.0
) -> int:
    """Run until SIGTERM/SIGINT (exit 0); SIGHUP re-reads --config. Waits for a store the daemon has yet to create."""
    settings = load_settings(config, overrides)
    end_with_parent(signal.SIGKILL)  # never outlive the daemon that supervises it (`kvtier.core.parent`)
    stop = threading.Event()
    previous = {s: signal.signal(s, off_handler(stop.set)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if not store_exists(root):
            log.warning("no store at %s yet: waiting up to %.0fs for the daemon to create it", root, wait_for_store_s)
            waited = 0.0
            while not store_exists(root) and waited < wait_for_store_s and not stop.wait(0.5):
                waited += 0.5
            if stop.is_set():
                return 0
            if not store_exists(root):
                raise StoreNotFound(
                    f"no kvtier store at {root} after waiting {wait_for_store_s:g}s: start the daemon that creates it "
                    "(kvtier serve, or systemctl start kvtier), or pass the --store it uses"
                )
        if not _lock_instance(root, stop):
            return 0
        prio = lower_priority()
        store = open_store(root, stop=stop)
        try:
            verifier = Verifier(store, settings)
            if stop.is_set():
                return 0

            def request_stop() -> None:
                stop.set()  # the decision channel's waits end with it
                verifier.request_stop()

            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, off_handler(request_stop))
            signal.signal(signal.SIGHUP, off_handler(lambda: _reload(verifier, config, overrides)))
            log.info(
                "verifier on %s (pid %d, %s, rate %d B/s, %d B/s while the disk is busy)",
                store.root,
                os.getpid(),
                prio,
                settings.rate_bytes_per_s,
                settings.busy_rate_bytes_per_s,
            )
            verifier.run()
        finally:
            store.close()
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit the verifier process once `run` has returned, skipping the interpreter's teardown.

    Why: a nice-19 process gets only a small share of CPUs that are busy at normal priority, and the teardown
    (collecting every module's objects) is CPU it would wait for; with torch loaded, as the verifier once had it,
    it cost a good part of a CPU-second (at SCHED_IDLE, which it used to take, its exit took minutes beside CPU
    burners on every core).
    Nothing is left to tear down by then: the store is closed, the status saved, the lock goes with the process."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _lock_instance(root: str | Path, stop: threading.Event) -> bool:
    """Hold <store>/verifier.lock for the life of the process: one verifier per store; a second one waits.
    False if asked to stop while waiting."""
    fd = os.open(os.path.join(root, VERIFIER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True  # fd stays open (and locked) until the process exits
        except BlockingIOError:
            if not waited:
                log.warning("another verifier holds %s; waiting for it to exit", os.path.join(root, VERIFIER_LOCK))
                waited = True
            if stop.wait(1.0):
                os.close(fd)
                return False


def _reload(verifier: Verifier, config: str | Path | None, overrides: Mapping[str, Any]) -> None:
    try:
        verifier.reload(load_settings(config, overrides))
    except KvtierError as exc:  # a bad config on reload keeps the running settings
        log.error("reload failed, keeping the running settings: %s", exc)
