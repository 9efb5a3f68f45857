"""What the index says about the store as a whole: namespaces, published limits, shared documents, stats."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import lmdb

from kvtier.core.forms import CacheForm
from kvtier.core.store_config import StoreConfig, StoreLimits
from kvtier.core.versions import VersionKey
from kvtier.store.context import StoreContext
from kvtier.store.decisions import PutDoc
from kvtier.store.errors import NamespaceError, StoreReadOnly
from kvtier.store.index import NamespaceEntry, seal, unseal
from kvtier.store.io import replace_whole
from kvtier.store.record import MAX_VERSION_KEY_BYTES, Codec

log = logging.getLogger(__name__)

_META_DOCS = frozenset({"rollout", "write_back"})  # JSON documents other processes may keep in the index's `meta`
# Progress, not state: JSON documents kept in a file of the store's root (`<name>.json`), replaced whole by rename and
# never synced, so that publishing one (the verifier's status and heartbeat, every few seconds) is no index commit of
# the daemon's and no flush of its disk. A crash may leave an older one, or none: its reader starts over.
_FILE_DOCS = frozenset({"verifier"})


class Catalog:
    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx

    # ----------------------------------------------------------------- namespaces

    def register_namespace(
        self,
        version_key: VersionKey,
        *,
        live: bool = True,
        codecs: Mapping[CacheForm, str] | None = None,
        identity: Mapping[str, Any] | None = None,
    ) -> bytes:
        if len(version_key.canonical()) > MAX_VERSION_KEY_BYTES:
            raise NamespaceError(f"version key is over {MAX_VERSION_KEY_BYTES} bytes as JSON: shorten its fields")
        codec_pairs = tuple(sorted((f.value, Codec.parse(c).name.lower()) for f, c in (codecs or {}).items()))
        index = self._ctx.index
        ns = version_key.namespace
        now = time.time()

        def put(txn: lmdb.Transaction) -> None:
            old = index.namespace(txn, ns)
            registered = old.registered_at if old else now
            kept = identity if identity is not None else (old.identity if old else None)
            entry = NamespaceEntry(version_key, live, registered, 0.0 if live else now, codec_pairs, kept)
            txn.put(ns, entry.pack(), db=index.ns)

        index.update(put)
        return ns

    def retire_namespace(self, namespace: bytes) -> bool:
        index = self._ctx.index

        def put(txn: lmdb.Transaction) -> bool:
            old = index.namespace(txn, namespace)
            if old is None:
                return False
            txn.put(namespace, dataclasses.replace(old, live=False, retired_at=time.time()).pack(), db=index.ns)
            return True

        return index.update(put)

    def namespaces(self) -> dict[bytes, NamespaceEntry]:
        with self._ctx.index.read() as txn:
            return {bytes(k): NamespaceEntry.unpack(v) for k, v in txn.cursor(db=self._ctx.index.ns)}

    # ----------------------------------------------------------------- documents in `meta`

    def set_limits(self, budget_bytes: int, form_quotas: Mapping[CacheForm, int]) -> None:
        """Change the byte budget and per-form quotas the writer enforces (a reload), and publish them."""
        self._ctx.config = dataclasses.replace(
            self._ctx.config, budget_bytes=budget_bytes, form_quotas=StoreConfig.quotas(form_quotas)
        )
        self.publish_limits()

    def publish_limits(self) -> None:
        """Write the limits into `meta` for the cleaner and `kvtier audit`."""
        index = self._ctx.index
        doc = {
            "budget_bytes": self._ctx.config.budget_bytes,
            "form_quotas": {f.value: n for f, n in self._ctx.quotas.items()},
        }
        index.update(lambda txn: txn.put(b"limits", seal(json.dumps(doc, sort_keys=True).encode()), db=index.meta))

    def limits(self) -> StoreLimits | None:
        """The limits the writer last published (None if no writer has yet)."""
        with self._ctx.index.read() as txn:
            raw = txn.get(b"limits", db=self._ctx.index.meta)
        if raw is None:
            return None
        doc = json.loads(unseal(raw))
        quotas = StoreConfig.quotas({CacheForm(f): int(n) for f, n in doc["form_quotas"].items()})
        return StoreLimits(int(doc["budget_bytes"]), quotas)

    def meta_doc(self, name: str) -> dict[str, Any] | None:
        if name in _FILE_DOCS:
            return self._file_doc(name)
        if name not in _META_DOCS:
            raise KeyError(name)
        with self._ctx.index.read() as txn:
            raw = txn.get(f"doc:{name}".encode(), db=self._ctx.index.meta)
        return None if raw is None else json.loads(unseal(raw))

    def put_meta_doc(self, name: str, doc: Mapping[str, Any]) -> None:
        body = json.dumps(doc, sort_keys=True).encode()
        if name in _FILE_DOCS:
            if self._ctx.readonly:
                raise StoreReadOnly("this store was opened read-only")
            self._put_file_doc(name, body)
            return
        if name not in _META_DOCS:
            raise KeyError(name)
        self._ctx.decide(PutDoc(name, body))

    def apply_put_doc(self, d: PutDoc) -> None:
        if d.name in _FILE_DOCS:  # (sent by a verifier from before these were files: written as it would now)
            self._put_file_doc(d.name, bytes(d.body))
            return
        if d.name not in _META_DOCS:
            raise KeyError(d.name)
        index = self._ctx.index
        body = seal(bytes(d.body))
        index.update(lambda txn: txn.put(f"doc:{d.name}".encode(), body, db=index.meta))

    def _file_doc(self, name: str) -> dict[str, Any] | None:
        """A file document, or None where there is none or what a crash left of it does not parse."""
        try:
            with open(os.path.join(self._ctx.root, f"{name}.json"), "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return None
        except ValueError:
            log.warning("%s.json in %s does not parse: read as absent until it is written again", name, self._ctx.root)
            return None
        return doc if isinstance(doc, dict) else None

    def _put_file_doc(self, name: str, body: bytes) -> None:
        """The document replaced whole (`io.replace_whole`). One process writes it at a time (the verifier holds
        `verifier.lock`), so the partial file has one name, which the next writer truncates."""
        root = self._ctx.root
        replace_whole(os.path.join(root, f"{name}.json"), os.path.join(root, f".{name}.json.partial"), body)

    # ----------------------------------------------------------------- stats

    def stats(self, io_backend: str) -> dict[str, Any]:
        ctx, index = self._ctx, self._ctx.index
        with index.read() as txn:
            usage = index.usage(txn)
            nseg = txn.stat(index.seg)["entries"]
            ndirty = txn.stat(index.dirty)["entries"]
            ntomb = txn.stat(index.gone)["entries"] if index.gone is not None else 0
        namespaces = self.namespaces()
        quotas = ctx.quotas
        forms = {
            f.value: {
                "records": u.records,
                "record_bytes": u.record_bytes,
                "payload_bytes": u.payload_bytes,
                "stored_bytes": u.stored_bytes,
                "codec_ratio": round(u.payload_bytes / u.stored_bytes, 3) if u.stored_bytes else None,
                "quota_bytes": quotas.get(f),
            }
            for f, u in usage.items()
        }
        return {
            "root": ctx.root,
            "io_backend": io_backend,
            "budget_bytes": ctx.config.budget_bytes or None,
            "record_bytes": sum(u.record_bytes for u in usage.values()),
            "records": sum(u.records for u in usage.values()),
            "forms": forms,
            "segments": nseg,
            "unverified": ndirty,
            "evicted_tombstones": ntomb,
            "namespaces": {
                "live": sum(n.live for n in namespaces.values()),
                "retired": sum(not n.live for n in namespaces.values()),
            },
        }
