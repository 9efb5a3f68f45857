"""The verifier's knobs: defaults here, rates and limits from the daemon's config file (`kvtier.core.config`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvtier.core.config import load_config
from kvtier.core.forms import CacheForm
from kvtier.store import StoreConfig, StoreLimits


@dataclasses.dataclass(frozen=True, slots=True)
class VerifierSettings:
    """How fast and how often the verifier reads, and when the cleaner acts."""

    rate_bytes_per_s: int = 64 << 20  # payload bytes read (verify) and copied (compaction) per second; 0: unlimited
    # ... while other processes use the store's disk (`kvtier.verifier.busy`), like md's sync_speed_min beside its
    # sync_speed_max. md's floor is 1/200 of its cap; a verifier must still finish sweeps under constant load, so ours
    # is 1/16 of the default rate: 4 MiB/s re-reads a 1 TB store in about 3 days however busy the disk stays. At most
    # the rate (0 or more than it: the rate).
    busy_rate_bytes_per_s: int = 4 << 20
    sweep_interval_s: float = 300.0  # a full rate-limited sweep starts this long after the previous one finished
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
    profiles: tuple[
        str, ...
    ] = ()  # profiles (names or paths) whose layouts the layout check knows, besides the bundled ones

    def replace(self, **changes: object) -> VerifierSettings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def settings_from_config(path: str | Path, base: VerifierSettings = VerifierSettings()) -> VerifierSettings:
    """Rates, sweep interval, store limits and profiles from the daemon's TOML config (typed errors name the key)."""
    cfg = load_config(path)
    quotas = StoreConfig.quotas({CacheForm(f): n for f, n in cfg.store.quota_bytes.items() if n})
    return dataclasses.replace(
        base,
        rate_bytes_per_s=cfg.verifier.rate_bytes_per_s,
        busy_rate_bytes_per_s=cfg.verifier.busy_rate_bytes_per_s,
        sweep_interval_s=cfg.verifier.sweep_interval_s,
        limits=StoreLimits(cfg.store.budget_bytes, quotas),
        profiles=cfg.profiles,
    )
