"""`kvtier audit --cluster`: a census of kvtier's objects in the cluster per namespace and form, sampled checks.

Mooncake's client API cannot list keys (it has existence, get, put and remove); its master's HTTP admin server
can (`/get_all_keys`). With `[cluster] admin` set the audit counts what a master lists. Without it, it counts
what this node knows it wrote: the local store's records in the write-through forms, each asked for in the
cluster (`absent`: lost, evicted, or not written through yet). Then a random sample of the objects found is
fetched and verified as a reader would (header, key, length, payload checksum; not the layout, which needs
the reader's profile).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from kvtier.cluster import header as H
from kvtier.cluster.errors import ClusterUnavailable
from kvtier.cluster.link import probe
from kvtier.cluster.mooncake_client import BUFFER_TOO_SMALL, NOT_FOUND, TOO_LARGE, MooncakeClient
from kvtier.core.cluster_config import ClusterConfig
from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.store import DiskStore

log = logging.getLogger(__name__)

BATCH = 256  # names per existence call
ATTEMPTS = 3  # gets per sampled object before its verdict is "error" / "unavailable"
# Sampled verdicts that mean the bytes under a kvtier key are not what a kvtier writer put there.
CORRUPT = frozenset(v.value for v in H.Verdict) - {H.Verdict.OK.value}


@dataclasses.dataclass(slots=True)
class FormTally:
    objects: int = 0  # in the cluster
    absent: int = 0  # written by this node (its store has them) but not in the cluster; local source only


@dataclasses.dataclass(slots=True)
class ClusterAuditReport:
    """What one cluster audit saw. `problems`: a sampled object that is not what its writer put there."""

    source: str  # where the key list came from: the master's admin URL, or "local index"
    counts: dict[bytes, dict[CacheForm, FormTally]]
    other_keys: int  # keys not under this node's key_prefix (other users of a shared cluster, other prefixes)
    sampled: int
    verdicts: dict[str, int]  # per sampled object: a header verdict (ok, garbage, ...), missing (gone since
    # listed), too_big (over staging_bytes), error / unavailable (no object after ATTEMPTS gets)

    @property
    def problems(self) -> bool:
        return any(self.verdicts.get(v, 0) for v in CORRUPT)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "namespaces": {
                ns.hex(): {f.value: dataclasses.asdict(t) for f, t in forms.items()}
                for ns, forms in self.counts.items()
            },
            "other_keys": self.other_keys,
            "sampled": self.sampled,
            "verdicts": self.verdicts,
        }


def audit_cluster(
    cfg: ClusterConfig, store: DiskStore, sample: int = 32, seed: int | None = None
) -> ClusterAuditReport:
    """Count and sample the cluster's kvtier objects; raises ClusterUnavailable / ClusterSetupError if unreachable."""
    # a master that does not answer would hold Mooncake's setup (and the GIL) for longer than any of our deadlines
    probe(cfg)
    client = MooncakeClient(cfg)
    try:
        counts: dict[bytes, dict[CacheForm, FormTally]] = collections.defaultdict(
            lambda: collections.defaultdict(FormTally)
        )
        present: list[ObjectKey] = []
        other = 0
        if cfg.admin:
            source, names = _list_keys(cfg)
            for name in names:
                key = H.parse_name(cfg.key_prefix, name)
                if key is None:
                    other += 1
                else:
                    present.append(key)
                    counts[key.namespace][key.form].objects += 1
        else:
            source = "local index"
            for keys in _written_through(cfg, store):
                for key, found in zip(keys, client.exists([H.object_name(cfg.key_prefix, k) for k in keys])):
                    if found is None:
                        raise ClusterUnavailable(f"the cluster answered an existence call with an error ({key})")
                    tally = counts[key.namespace][key.form]
                    if found:
                        tally.objects += 1
                        present.append(key)
                    else:
                        tally.absent += 1
        picked = random.Random(seed).sample(present, min(sample, len(present)))
        verdicts = _deep_check(client, cfg, picked)
    finally:
        client.close()
    return ClusterAuditReport(source, {ns: dict(f) for ns, f in counts.items()}, other, len(picked), verdicts)


def _list_keys(cfg: ClusterConfig) -> tuple[str, list[str]]:
    """Every key a master lists (the first of `admin` that answers: a standby of HA masters refuses)."""
    errors = []
    for url in (u.strip().rstrip("/") for u in cfg.admin.split(";") if u.strip()):
        try:
            with urllib.request.urlopen(f"{url}/get_all_keys", timeout=cfg.load_timeout_s) as resp:
                return url, resp.read().decode().split()
        except (urllib.error.URLError, OSError) as exc:
            errors.append(f"{url}: {exc}")
    raise ClusterUnavailable(f"no master admin server listed the cluster's keys ({'; '.join(errors)})")


def _written_through(cfg: ClusterConfig, store: DiskStore) -> Iterator[list[ObjectKey]]:
    """Batches of the local store's keys in the forms this node writes through."""
    after = None
    while rows := store.iter_records(after, BATCH):
        after = rows[-1].key
        if keys := [r.key for r in rows if cfg.write_through.covers(r.key.form)]:
            yield keys


def _deep_check(client: MooncakeClient, cfg: ClusterConfig, keys: list[ObjectKey]) -> dict[str, int]:
    """Fetch each key's object (at most staging_bytes) and verify it; verdict counts."""
    return dict(collections.Counter(_verdict(client, cfg, key) for key in keys))


def _verdict(client: MooncakeClient, cfg: ClusterConfig, key: ObjectKey) -> str:
    """One object's verdict. A get that failed (an error code, no answer in time, or the breaker's wait after
    another failure: a get outliving the master's kv lease fails) is tried again, ATTEMPTS times in all."""
    got: list[str] = []

    def sink(_i: int, data: memoryview | int) -> None:
        if isinstance(data, int):
            got.append(
                "missing" if data == NOT_FOUND else "too_big" if data in (BUFFER_TOO_SMALL, TOO_LARGE) else "error"
            )
        else:
            got.append(H.verify_stored(data, key).value)

    for _ in range(ATTEMPTS):
        got.clear()
        try:  # one get each: an object of unknown size takes the whole staging buffer
            client.get([H.object_name(cfg.key_prefix, key)], [cfg.staging_bytes], sink)
        except ClusterUnavailable:
            got.append("unavailable")
        if got[0] not in ("error", "unavailable"):
            break
        time.sleep(cfg.retry_s)  # the breaker lets a call through again after retry_s
    return got[0]
