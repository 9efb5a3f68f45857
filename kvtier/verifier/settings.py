"""The verifier's knobs: the config's `[verifier]` table (`kvtier.core.config.VerifierConfig`, its defaults from
the schema) plus what only the verifier process tunes, and the store limits and profiles it is handed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvtier.core.config import VerifierConfig, load_config
from kvtier.store import StoreLimits


@dataclasses.dataclass(frozen=True, slots=True)
class VerifierSettings(VerifierConfig):
    """`[verifier]`'s keys (rates, sweep interval, ...) and how often the verifier reads, and when the cleaner
    acts. The fields below are not config keys: they are the process's own tuning, set in code and tests."""

    maintenance_interval_s: float = 30.0  # index scan + cleaner actions (sooner when the store is over its limits)
    poll_s: float = 1.0  # idle wake-up when no watchdog hint arrives (hints are never relied on)
    batch_records: int = 64  # records per read transaction / per write transaction
    batch_bytes: int = 8 << 20  # record bytes per compaction batch, and per commit stamping new records verified
    read_bytes: int = 1 << 20  # record bytes per re-read of records already verified (one short read each)
    compact_below: float = 0.5  # compact a sealed segment whose live fraction is below this
    quarantine_retention_s: float = 3600.0  # quarantined records stay visible to audits this long, then are dropped
    tombstone_retention_s: float = 3600.0  # an evicted key reads as `evicted` (not `missing`) this long
    orphan_grace_s: float = 300.0  # stray files and uncommitted tails untouched for less than this are left alone
    evict_high: float = 0.95  # start evicting at this fraction of the budget / a quota ...
    evict_low: float = 0.85  # ... and evict down to this fraction
    state_interval_s: float = 2.0  # persist progress and heartbeat at most this often
    limits: StoreLimits | None = None  # None: the limits the daemon published in the store
    # profiles (names or paths) whose layouts the layout check knows, besides the bundled ones
    profiles: tuple[str, ...] = ()

    def replace(self, **changes: object) -> VerifierSettings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def settings_from_config(path: str | Path, base: VerifierSettings = VerifierSettings()) -> VerifierSettings:
    """`[verifier]`'s keys, the store's limits and the profiles from the daemon's TOML config (typed errors
    name the key), over `base`'s own tuning."""
    cfg = load_config(path)
    keys = {f.name: getattr(cfg.verifier, f.name) for f in dataclasses.fields(VerifierConfig)}
    quotas = tuple((f, n) for f, n in cfg.store.form_quotas if n)
    return dataclasses.replace(base, **keys, limits=StoreLimits(cfg.store.budget_bytes, quotas), profiles=cfg.profiles)
