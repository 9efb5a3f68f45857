"""The verifier's changes to the index, as records: what it decided, never how to lock for it.

While a daemon serves a store it is the index's only writer: the verifier reads the index, decides, and sends
these records to the daemon, which applies each in one short write transaction of its own (`kvtier.store.channel`).
A verifier stopped at any moment then holds no lock the daemon waits on. With no daemon, the same records are
applied in the verifier's own process (`DiskStore.apply_decision`).

Every removal or repoint carries what the verifier saw (the record's sequence number, its state, where it lay),
and is applied only if the record is still that: a decision that arrives late cannot hit a record that changed.
"""

from __future__ import annotations

from typing import Any

import msgspec


class DropIf(msgspec.Struct, array_like=True, frozen=True):
    """Drop `key` (an encoded index key) if its entry still has sequence `seq` (-1: any), state `state` (-1: any)
    and, unless `pinned_ok`, no pin in force when the decision is applied."""

    key: bytes
    seq: int = -1
    state: int = -1
    pinned_ok: bool = True


class Move(msgspec.Struct, array_like=True, frozen=True):
    """A relocated record: repoint `key` from where it was read to its durable copy, if it is still there."""

    key: bytes
    old_segment: int
    old_offset: int
    old_seq: int
    segment: int
    offset: int
    record_len: int


class Drop(msgspec.Struct, tag="drop", frozen=True):
    """Returns how many were dropped. `tombstone`: an eviction (lookups answer `evicted` until pruned)."""

    items: list[DropIf]
    tombstone: bool = False


class Quarantine(msgspec.Struct, tag="quarantine", frozen=True):
    """Returns whether the key was indexed."""

    key: bytes
    reason: int


class PruneTombstones(msgspec.Struct, tag="prune", frozen=True):
    """Forget the tombstones of `keys` (encoded keys the sender found expired) still written before
    `older_than`; returns how many went."""

    older_than: float
    keys: list[bytes]


class Stamp(msgspec.Struct, tag="stamp", frozen=True):
    """Records that passed verification, each with the index value it was read under: stamp verified_at and
    clear the dirty row where the value is unchanged."""

    rows: list[tuple[bytes, bytes]]
    at: float


class PutDoc(msgspec.Struct, tag="doc", frozen=True):
    """A shared JSON document of the index's `meta` (the verifier's status and heartbeat)."""

    name: str
    body: bytes  # JSON


class AllocateSegment(msgspec.Struct, tag="allocate", frozen=True):
    """Returns a new segment id, registered unsealed, for the sender to create, flock and append."""


class SealSegment(msgspec.Struct, tag="seal", frozen=True):
    seg_id: int


class SealAbandoned(msgspec.Struct, tag="seal_abandoned", frozen=True):
    """Seal each of `seg_ids` (unsealed segments the sender found with no appender holding them) whose appender is
    still gone when the decision is applied; returns how many were sealed. The sender scans the segment table and
    probes the files itself and sends this only when it found some: the daemon re-probes the few it names and never
    scans on the verifier's behalf. An older verifier's request names none (it left the scan to the daemon): it
    seals nothing, and is answered, so that verifier's maintenance goes on."""

    seg_ids: list[int] = msgspec.field(default_factory=list)


class Repoint(msgspec.Struct, tag="repoint", frozen=True):
    """Returns how many moved, per batch. The copies are durable (synced) before this is sent."""

    batches: list[list[Move]]


class UnlinkSegment(msgspec.Struct, tag="unlink", frozen=True):
    """Returns whether the segment was unlinked (empty, sealed, no reader can still see it, no appender)."""

    seg_id: int


Decision = (
    Drop | Quarantine | PruneTombstones | Stamp | PutDoc | AllocateSegment | SealSegment | SealAbandoned | Repoint
) | UnlinkSegment


class Reply(msgspec.Struct, frozen=True):
    value: Any = None
    error: str = ""  # non-empty: the decision was not applied (the message says why)


_encoder = msgspec.msgpack.Encoder()
_decision = msgspec.msgpack.Decoder(Decision)
_reply = msgspec.msgpack.Decoder(Reply)


def encode(obj: Decision | Reply) -> bytes:
    return _encoder.encode(obj)


def decode_decision(raw: bytes) -> Decision:
    return _decision.decode(raw)


def decode_reply(raw: bytes) -> Reply:
    return _reply.decode(raw)
