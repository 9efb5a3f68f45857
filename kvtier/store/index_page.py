"""Index rows a page at a time, as columns: what a walk over every record of the store reads.

Contract (`IndexPage.parse(keys, values, atimes)`, built by `DiskStore.index_page(after, limit)` from one short read
transaction):
- `keys`: the encoded keys (`index.encode_key`), in key order; `values`: their index values as stored.
- `entries`: one ENTRY_V2_DTYPE row per key. A v2 value is taken as it lies, its seal checked; a v1 value is
  parsed by `IndexEntry.unpack` and put in the same columns (`version` 1). `parsed[i]` is False where the value
  is corrupt (a seal, length or field that does not check): that row is zeros and names nothing.
- `atimes`: each record's last access time, 0.0 where it has none or its value is corrupt (as `atime_or_zero`).
- `group_of` / `groups`: each row's (namespace, form, group), as the ObjectKey of the group's first row.
- `key(i)` / `entry(i)`: the ObjectKey and IndexEntry of one row; `keys_at(rows)` the ObjectKeys of many: for the
  rows a caller acts on.

Why: a walk over every row (the verifier's inventory, every maintenance pass) that builds an ObjectKey, an IndexEntry
and a float per row costs several microseconds of Python per record; the columns cost a fraction of that, so a
store of millions of records is walked without the verifier taking a CPU for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvtier.core.tier import ObjectKey
from kvtier.store.context import entry_or_none
from kvtier.store.index import ENTRY_V2_DTYPE, TIME, IndexEntry, RecordState, decode_key, sealed_rows
from kvtier.store.record import FORMAT_VERSION, FORMS_BY_CODE, Codec
from kvtier.store.record_check import entry_rows

_FORMS = np.asarray(sorted(FORMS_BY_CODE), np.uint8)
_TIME_SEALED = np.dtype([("t", "<f8"), ("seal", "<u8")])
assert _TIME_SEALED.itemsize == TIME.size + 8


@dataclasses.dataclass(frozen=True, slots=True)
class IndexPage:
    """One page of index rows as columns (the module docstring states the contract)."""

    keys: list[bytes]
    values: list[bytes]
    entries: np.ndarray  # ENTRY_V2_DTYPE, one row per key
    parsed: np.ndarray  # bool per key
    atimes: np.ndarray  # float64 per key
    # per key, its (namespace, form, group) in `groups`: each one's ObjectKey of its first row, decode_key's checks
    # passed (rows of one group differ only in their block hash)
    group_of: np.ndarray  # int64 per key
    groups: list[ObjectKey]

    @classmethod
    def parse(cls, keys: list[bytes], values: list[bytes], atimes: Sequence[bytes | None]) -> IndexPage:
        n = len(keys)
        entries = np.zeros(n, ENTRY_V2_DTYPE)
        parsed = np.zeros(n, bool)
        size = ENTRY_V2_DTYPE.itemsize
        v2 = [i for i, v in enumerate(values) if len(v) == size]
        if v2:
            rows, good = sealed_rows([values[i] for i in v2], ENTRY_V2_DTYPE)
            good &= rows["version"] == FORMAT_VERSION
            # fields a value that unpacks must hold (a seal that checks over a bad field is a writer's bug)
            good &= (rows["state"] < len(RecordState)) & (rows["codec"] < len(Codec)) & np.isin(rows["form"], _FORMS)
            at = np.asarray(v2, np.int64)
            entries[at[good]] = rows[good]
            parsed[at[good]] = True
        # the rest (v1 values, and any a v2 check refused: a bad field is named there) one by one, as a load names them
        odd = np.flatnonzero(~parsed).tolist()
        found = [(i, e) for i, e in ((i, entry_or_none(values[i])) for i in odd) if e is not None]
        if found:
            at = np.asarray([i for i, _ in found], np.int64)
            entries[at] = entry_rows([e for _, e in found])
            parsed[at] = True
        ids: dict[bytes, int] = {}  # namespace + the key's bytes after the block hash (form code, group)
        group_of = np.fromiter((ids.setdefault(k[:16] + k[32:], len(ids)) for k in keys), np.int64, n)
        firsts = np.unique(group_of, return_index=True)[1].tolist()  # (ids are numbered in order of first row)
        return cls(keys, values, entries, parsed, _times(atimes), group_of, [decode_key(keys[i]) for i in firsts])

    def __len__(self) -> int:
        return len(self.keys)

    def key(self, i: int) -> ObjectKey:
        return decode_key(self.keys[i])

    def keys_at(self, rows: Sequence[int]) -> list[ObjectKey]:
        """The ObjectKeys of `rows`, each built from its group's parts and its own block hash."""
        groups, keys = self.groups, self.keys
        return [
            ObjectKey._make((g.namespace, keys[i][16:32], g.group, g.form))
            for i, g in zip(rows, (groups[j] for j in self.group_of[list(rows)].tolist()))
        ]

    def entry(self, i: int) -> IndexEntry | None:
        return entry_or_none(self.values[i]) if self.parsed[i] else None


def _times(values: Sequence[bytes | None]) -> np.ndarray:
    """Sealed time values as floats; 0.0 for a missing or corrupt one."""
    out = np.zeros(len(values), np.float64)
    size = _TIME_SEALED.itemsize
    have = [i for i, v in enumerate(values) if v is not None and len(v) == size]
    if have:
        raw = [values[i] for i in have]
        rows, good = sealed_rows(raw, _TIME_SEALED)  # type: ignore[arg-type]
        out[np.asarray(have, np.int64)[good]] = rows["t"][good]
    return out
