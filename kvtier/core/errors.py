"""Typed errors shared by every component; each carries a stable `code` for the wire and CLI."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.core.not_durable import NotDurableCount


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose; the message says what to do."""

    code = "error"


@dataclasses.dataclass(frozen=True, slots=True)
class RoomLeft:
    """What a tier said when it refused a batch for want of room: the limit (`budget`, `quota:<form>`, `disk`) and,
    where it knows them, the bytes left under that limit before the batch and the bytes the batch would have added
    (at most: a tier may refuse before it has found which of the batch's objects it holds already).
    A plain record, not the error: a refusal kept past its handler would keep its traceback's frames alive, and
    with them the index's read transactions and their reader slots."""

    limit: str
    room: int | None = None
    needed: int | None = None

    @property
    def exhausted(self) -> bool:
        """The tier said no room at all is left under the limit: at or over it, whatever a batch needs."""
        return self.room is not None and self.room <= 0

    def fits(self, objects: int) -> int | None:
        """Of the refused batch's `objects`, how many the room left would take at their average size: fewer than
        all of them (the batch did not fit), 0 when not one would; None where the tier did not say."""
        if self.exhausted:
            return 0
        if self.room is None or not self.needed:
            return None
        return min(self.room * objects // self.needed, objects - 1)


class OutOfRoom(KvtierError):
    """A tier refused a batch for want of room: its byte budget, a per-form quota, or the disk. Nothing of the batch
    is visible. `limit` names the limit; `left` says what the tier knows of the room (`RoomLeft`), so a writer can
    tell whether a smaller batch could go in before it asks again."""

    code = "store_full"

    def __init__(self, message: str, *, limit: str, room: int | None = None, needed: int | None = None) -> None:
        self.limit = limit
        self.left = RoomLeft(limit, room, needed)
        super().__init__(message)


class FileFieldError(KvtierError):
    """A settings file (profile, config) is malformed; names the offending field and the file."""

    noun = "field"

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None) -> None:
        self.field = field
        self.source = source
        where = f"{source}: " if source else ""
        what = f"{self.noun} '{field}': " if field else ""
        super().__init__(f"{where}{what}{message}")


class ProfileError(FileFieldError):
    """A model profile is malformed; names the offending field and the file it came from."""

    code = "bad_profile"


class ConfigError(FileFieldError):
    """The daemon's TOML config (also read by the verifier) is unreadable or has a bad, missing or unknown key."""

    code = "bad_config"
    noun = "key"

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None) -> None:
        super().__init__(message, field=key, source=source)

    @property
    def key(self) -> str | None:
        return self.field


class VersionError(KvtierError):
    """Data belongs to a namespace (model / kernel / compressor version) other than the one asked for."""

    code = "stale_version"


class LayoutError(KvtierError):
    """A tensor or record does not match the layout the current kernels read."""

    code = "abi_mismatch"


class StaleHandle(KvtierError):
    """A lease or write handle no longer names the object it was issued for (evicted, expired or released):
    look the prefix up again (or recompute). Raised in the daemon and, for reads through mapped pools, in the
    client when the slot's generation moved."""

    code = "stale_handle"


class NotDurable(KvtierError):
    """Objects an acknowledgement would cover are not committed to the store; `pending` counts them and
    `why` says how many for each typed cause (quota, budget, store error, timed out); `reasons` is its text."""

    code = "not_durable"

    def __init__(self, message: str, *, pending: int = 0, why: tuple[NotDurableCount, ...] = ()) -> None:
        self.pending = pending
        self.why = why
        self.reasons = tuple(map(str, why))
        super().__init__(message)
