"""The backend's part of the stats document: per-profile pools and leases, per-form routes summed over the
managers, the store's own document with the persister's counters, and what the verifier last published."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from kvtier.core.verifier_status import verifier_status
from kvtier.daemon.persister import Persister
from kvtier.daemon.runtime import Runtime
from kvtier.store import DiskStore
from kvtier.wire.stats import FormStats, LatencyHistogram, PoolStats, ProfileStats, StatsDoc, VerifierReport

if TYPE_CHECKING:  # status is served before the pools' modules (and torch) are loaded
    from kvtier.gpu.counters import FormCounts


def backend_stats(runtimes: Iterable[Runtime], store: DiskStore, persister: Persister, prewarm_pins: int) -> StatsDoc:
    profiles: list[ProfileStats] = []
    forms: dict[str, FormStats] = {}
    for rt in runtimes:
        snap = rt.manager.counters()
        pools: dict[str, PoolStats] = {}
        kinds: dict[str, set[str]] = {}  # per form, how its pools got their pages
        for pool in rt.manager.pools():
            p = pools.setdefault(pool.form.value, PoolStats())
            p.slots += pool.n_slots
            p.bytes += pool.n_slots * pool.slot_stride
            p.moving_bytes += pool.move.left if pool.move is not None else 0
            kinds.setdefault(pool.form.value, set()).add(pool.pages)
        for form, p in pools.items():
            p.used = snap.used_slots.get(form, 0)
            p.quota = snap.quota_slots.get(form, 0)
            p.pages = ", ".join(sorted(kinds[form]))
        profiles.append(
            ProfileStats(
                name=rt.name,
                namespace=rt.manager.namespace.hex(),
                hash_block_tokens=rt.profile.hash_block_tokens,
                device=str(rt.manager.device),
                pools=pools,
                live_leases=snap.live_leases,
                recovering=snap.recovering,
                leases_expired=snap.leases_expired,
            )
        )
        for form, f in snap.forms.items():
            _merge_form(forms.setdefault(form, FormStats()), f)
    doc = store.stats()
    doc["used_bytes"] = doc.get("record_bytes", 0)
    doc["bytes_by_state"] = {"live": doc.get("record_bytes", 0)}
    doc["persist_queue"] = persister.queued
    doc["persisted"] = persister.persisted
    doc["failed_passes"] = persister.failed_passes  # write-back passes in which the store refused a form
    doc["write_back_deferred_s"] = round(persister.deferred_s, 3)  # backlog batches' waits for durable offloads
    doc["write_back_blocked"] = persister.reasons()  # "<profile>/<form>: why", one per blocked form
    doc["write_back_backlog"] = persister.backlog()  # profile -> form -> sealed objects not yet in the store
    doc["write_back_stuck"] = persister.stuck()  # profile -> blocked form -> objects the store refused
    published = VerifierReport(**verifier_status(store))  # what the verifier last published in the index
    return StatsDoc(profiles=profiles, forms=forms, store=doc, prewarm_pins=prewarm_pins, verifier=published)


def _merge_form(out: FormStats, f: FormCounts) -> None:
    """Fold one manager's per-form counters into the daemon-wide ones (histogram buckets made cumulative)."""
    reasons = f.recompute
    out.lookups += f.objects_looked_up
    out.reuse += f.reuse
    out.recover += f.recover
    out.recompute += sum(reasons.values())
    out.recover_ok += f.recovers_ok
    out.recover_failed += f.recovers_failed
    out.admission_rejections += reasons.get("admission", 0)
    out.evictions += f.evictions
    for reason, n in reasons.items():
        out.recompute_reasons[reason] = out.recompute_reasons.get(reason, 0) + n
    lat = f.recovery_latency_s
    cumulative = np.cumsum(lat.counts).tolist()
    hist = out.recovery_latency
    if hist is None:
        les = ["+Inf" if le == float("inf") else le for le in lat.le]
        out.recovery_latency = LatencyHistogram([(le, c) for le, c in zip(les, cumulative)], lat.sum, lat.count)
    else:
        hist.buckets = [(le, n + c) for (le, n), c in zip(hist.buckets, cumulative)]
        hist.sum += lat.sum
        hist.count += lat.count
