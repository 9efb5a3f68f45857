"""Write-back refusals logged when they change, not once per refused batch.

Contract (`RefusalLog`, one per manager's write-back; called from whichever thread stores a batch):
- `refused(form, objects, kind, why)`: a batch of the form was refused. Logged at WARNING when the form was not
  refused before, or was refused for another `kind` (the tier's error type and the limit it names, e.g.
  `StoreFull/budget`), else at DEBUG and counted.
- `stored(form)`: a batch of the form went in. Where the form had been refused, logged at INFO with how many of
  its batches were refused since the warning.

Why: on a store at its budget every write-back round is refused until the cleaner makes room, and a daemon
whose engines offload durably asks about every offload. A warning per refusal was a log line per offload for as long
as the store stayed full (and the daemon's CPU to format and write each, beside the engines' requests); the daemon's
stats and health already name the forms refused and why (`Persister.blocked`), so the log says when that starts,
changes and ends.
"""

from __future__ import annotations

import logging
import threading

from kvtier.core.forms import CacheForm

log = logging.getLogger("kvtier.gpu.writeback")  # the write-back's logger, whose lines these were before


class RefusalLog:
    """Per form, the kind of refusal last logged and the refused batches since (see the module's contract)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[CacheForm, tuple[str, int]] = {}

    def refused(self, form: CacheForm, objects: int, kind: str, why: str) -> None:
        with self._lock:
            last = self._open.get(form)
            repeat = last is not None and last[0] == kind
            self._open[form] = (kind, last[1] + 1 if last is not None and repeat else 0)
        if repeat:
            log.debug("write-back of %d %s objects refused again: %s", objects, form.value, why)
        else:
            log.warning(
                "write-back of %d %s objects refused: %s (logged again when the reason changes or the form goes "
                "in again)",
                objects,
                form.value,
                why,
            )

    def stored(self, form: CacheForm) -> None:
        if form not in self._open:  # the common case, read without the lock (a refusal racing it is seen next time)
            return
        with self._lock:
            last = self._open.pop(form, None)
        if last is not None:
            log.info("write-back of %s objects goes in again (%d more batches refused since)", form.value, last[1])
