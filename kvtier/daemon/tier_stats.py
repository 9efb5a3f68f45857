"""Per-namespace counters of the raw tier ops: what each engine namespace (vLLM's, SGLang's) asked, hit, loaded
and stored through this daemon since it started. `kvtier status` and the metrics show them.

A namespace is one engine configuration (model, weights, kernels, KV layout), so a node sees a handful; still,
the metrics' label values must stay bounded whatever connects: the first `MAX_NAMESPACES` namespaces seen get a
row of their own, later ones are summed under "other" (and `engine` takes three values).
"""

from __future__ import annotations

import collections
import threading

import msgspec

from kvtier.core.forms import Reason
from kvtier.core.versions import VersionKey
from kvtier.wire.stats import EngineNamespaceStats

MAX_NAMESPACES = 32
OTHER = "other"


def engine_of(version_key: VersionKey) -> str:
    """vllm or sglang by the kernel ABI their tiers put in the version key ("vllm <version>;...",
    "sglang-<version>"), else other."""
    abi = version_key.kernel_abi
    if abi.startswith("vllm"):
        return "vllm"
    if abi.startswith("sglang"):
        return "sglang"
    return OTHER


class TierStats:
    """Thread-safe: the server's workers count tier ops of many connections at once."""

    def __init__(self, max_namespaces: int = MAX_NAMESPACES) -> None:
        self._max = max_namespaces
        self._rows: dict[str, EngineNamespaceStats] = {}
        self._conns: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _row(self, namespace: bytes, version_key: VersionKey | None = None) -> EngineNamespaceStats:
        name = namespace.hex()
        row = self._rows.get(name)
        if row is not None:
            return row
        if len(self._rows) >= self._max:
            return self._rows.setdefault(OTHER, EngineNamespaceStats(OTHER, OTHER, OTHER))
        engine = engine_of(version_key) if version_key is not None else OTHER
        model = version_key.model_id if version_key is not None else "?"
        row = self._rows[name] = EngineNamespaceStats(name, engine, model)
        return row

    def opened(self, namespace: bytes, version_key: VersionKey) -> None:
        with self._lock:
            row = self._row(namespace, version_key)
            self._conns[row.namespace] += 1

    def closed(self, namespace: bytes) -> None:
        with self._lock:
            row = self._row(namespace)
            self._conns[row.namespace] -= 1

    def looked_up(self, namespace: bytes, reasons: list[Reason]) -> None:
        with self._lock:
            row = self._row(namespace)
            row.lookups += len(reasons)
            row.hits += sum(1 for r in reasons if r is Reason.OK)

    def loaded(self, namespace: bytes, reasons: list[Reason], sizes: list[int]) -> None:
        with self._lock:
            row = self._row(namespace)
            ok = [n for r, n in zip(reasons, sizes) if r is Reason.OK]
            row.loads += len(ok)
            row.load_failures += len(reasons) - len(ok)
            row.bytes_loaded += sum(ok)

    def stored(self, namespace: bytes, sizes: list[int]) -> None:
        with self._lock:
            row = self._row(namespace)
            row.stores += len(sizes)
            row.bytes_stored += sum(sizes)

    def snapshot(self) -> list[EngineNamespaceStats]:
        """A copy of every row, with its open connections, in the order first seen ("other" where it fell)."""
        with self._lock:
            return [
                msgspec.structs.replace(r, connections=max(0, self._conns[r.namespace])) for r in self._rows.values()
            ]
