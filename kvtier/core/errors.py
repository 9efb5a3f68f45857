"""Typed errors shared by every component; each carries a stable `code` for the wire and CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.core.not_durable import NotDurableCount


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose; the message says what to do."""

    code = "error"


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
