"""The disk store's knobs (`[store]` in the daemon's config) and the limits its writer publishes.

In `core` because the daemon's config is read in core (and by the verifier), and the store runs on the same
record: one record, its defaults taken from the schema (`kvtier.core.config_schema`), no second list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from kvtier.core.config_schema import default
from kvtier.core.forms import CacheForm
from kvtier.core.layout import DISK_ALIGNMENT

FormQuotas = tuple[tuple[CacheForm, int], ...]


def _quotas(value: Mapping[CacheForm, int] | Mapping[str, int] | FormQuotas) -> FormQuotas:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted(((CacheForm(f), int(n)) for f, n in items), key=lambda kv: kv[0].value))


@dataclasses.dataclass(frozen=True, slots=True)
class StoreConfig:
    """Knobs of one store; the budget and quotas count record bytes on disk (header + stored payload).

    Built in code (a vLLM `store_dir` tier, tests) it starts from the schema's `code` defaults: no budget, no
    root (DiskStore takes the root as its argument). `form_quotas` takes a mapping of form (or form name) to
    bytes too, kept sorted by form."""

    root: Path | None = default("store.root")  # noqa: RUF009 (None: the schema says so, called once at import)
    budget_bytes: int = default("store.budget_bytes")  # 0: no budget
    form_quotas: FormQuotas = ()
    io_threads: int = default("store.io_threads")  # writer threads (extents are built and written in parallel)
    write_piece_bytes: int = default("store.write_piece_bytes")  # 0: each extent in one write
    read_threads: int = default("store.read_threads")  # where a load reads with threads (no native AIO, GDS)
    io_backend: str = default("store.io_backend")  # auto | gds | odirect | buffered
    device_checksums: str = default("store.device_checksums")  # auto | on | off (auto: on a GDS store)
    codec: str = default("store.codec")  # none | zstd: the daemon's new records
    create: bool = default("store.create")  # the daemon makes the root's parents too
    segment_bytes: int = default("store.segment_bytes")
    min_free_bytes: int | None = default("store.min_free_bytes")  # None (in code only): no statvfs check
    atime_flush_s: float = default("store.atime_flush_s")
    buffer_retain_bytes: int = default("store.buffer_retain_bytes")

    def __post_init__(self) -> None:
        object.__setattr__(self, "form_quotas", _quotas(self.form_quotas))
        if not 0 <= self.atime_flush_s <= 86400:  # a background thread waits this long between writes
            raise ValueError(f"atime_flush_s must be between 0 and 86400 seconds, got {self.atime_flush_s}")
        if self.io_threads < 1 or self.read_threads < 1:
            raise ValueError("io_threads and read_threads must be >= 1")
        if self.write_piece_bytes < 0 or self.write_piece_bytes % DISK_ALIGNMENT:  # O_DIRECT: aligned offsets
            raise ValueError(
                f"write_piece_bytes must be 0 or a multiple of {DISK_ALIGNMENT}, got {self.write_piece_bytes}"
            )

    @property
    def quota_bytes(self) -> dict[str, int]:
        """The per-form quotas as the config file writes them (form name -> bytes)."""
        return {f.value: n for f, n in self.form_quotas}

    @staticmethod
    def quotas(mapping: Mapping[CacheForm, int]) -> FormQuotas:
        return _quotas(mapping)


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonStoreConfig(StoreConfig):
    """`[store]` as the daemon's config holds it: the same knobs, and a root that is always set, because both
    modes' defaults name one and a file can only replace it. Only a StoreConfig built in code (a store opened by
    path) goes without one."""

    root: Path


@dataclasses.dataclass(frozen=True, slots=True)
class StoreLimits:
    """The byte budget and per-form quotas the writer enforces, as it published them in the index (0: none)."""

    budget_bytes: int = 0
    form_quotas: FormQuotas = ()

    def quota(self, form: CacheForm) -> int:
        return dict(self.form_quotas).get(form, 0)
