"""watchdog events on segments/ wake the verifier early; they are hints only (inotify drops events on overflow)."""

from __future__ import annotations

import logging
import threading

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

log = logging.getLogger(__name__)


class _Wake(FileSystemEventHandler):
    def __init__(self, wake: threading.Event) -> None:
        self._wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        self._wake.set()


class SegmentHints:
    """Sets `wake` on any change under the segments directory; a failure to watch only costs latency."""

    def __init__(self, seg_dir: str, wake: threading.Event) -> None:
        self._seg_dir = seg_dir
        self._wake = wake
        self._observer: BaseObserver | None = None  # Observer is a per-platform alias, not a type

    def start(self) -> bool:
        try:
            observer = Observer()
            observer.schedule(_Wake(self._wake), self._seg_dir, recursive=False)
            observer.daemon = True
            observer.start()
        except OSError as exc:
            log.warning("cannot watch %s (%s): polling only", self._seg_dir, exc)
            return False
        self._observer = observer
        return True

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
