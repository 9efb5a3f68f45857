"""KV events (issue 39): a ZeroMQ subscriber's view of which blocks the node holds equals the store's.

A real daemon publishes on an ipc endpoint; an engine-style raw tier client stores objects through it; the
supervised verifier's cleaner evicts over a quota (in its own process, applied by the daemon). The subscriber
reads the PUB stream as a router would (topic, sequence, msgpack batch), asks the ROUTER for what it missed
before it joined, and ends holding exactly the store's live keys: every block stored once, evicted once, in order.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from kvtier.client import Client, TierClient, TierFull
from kvtier.core.config import config_from_dict, load_config
from kvtier.core.errors import ConfigError
from kvtier.core.events_config import EventsConfig
from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.daemon import kv_events as E
from kvtier.daemon.events import EventPublisher
from kvtier.store import DiskStore, RecordState, StoreConfig
from kvtier.store.record import record_length
from support.daemon import DaemonProc

VKEY = VersionKey("test/engine", "xxh3_128:00", "vllm 0.32.0;cpu;attn=TEST", "none", "none", "bf16;chunk=4096")
GROUPS = [("eng.g0.full", CacheForm.COMPRESSED), ("eng.g1.swa", CacheForm.SWA)]
DIGEST = bytes(range(16))
OBJ = 4096
N = 24
QUOTA = 8 * record_length(OBJ)  # the cleaner evicts the compressed group down to 85% of it


class Subscriber:
    """A router's side: SUB for the live stream, REQ-style DEALER to the ROUTER for the sequence numbers missed."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kvtier")
        self.sub.connect(endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.next_seq = 0
        self.batches: list[tuple[int, E.KVEventBatch]] = []

    def _take(self, topic: bytes, seq_bytes: bytes, payload: bytes) -> None:
        assert topic == b"kvtier-test"
        seq = int.from_bytes(seq_bytes, "big")
        if seq < self.next_seq:  # a replayed batch that also came live
            return
        if seq > self.next_seq:  # joined late or lost some: ask for them, then take this one
            self._replay_from(self.next_seq, seq)
        assert seq == self.next_seq, (seq, self.next_seq)
        self.batches.append((seq, E.decode_batch(payload)))
        self.next_seq = seq + 1

    def _replay_from(self, first: int, until: int) -> None:
        self.replay.send_multipart((b"", first.to_bytes(8, "big")))
        while True:
            assert self.replay.poll(10_000), "no replay answer"
            _, topic, seq_bytes, payload = self.replay.recv_multipart()
            assert topic in (b"kvtier-test", b"")
            if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                return
            seq = int.from_bytes(seq_bytes, "big")
            if self.next_seq <= seq < until:
                assert seq == self.next_seq
                self.batches.append((seq, E.decode_batch(payload)))
                self.next_seq = seq + 1

    def drain(self, wait_ms: int = 200) -> None:
        while self.sub.poll(wait_ms):
            self._take(*self.sub.recv_multipart())

    def view(self) -> tuple[set[tuple[bytes, bytes, int | None]], list[str]]:
        """Blocks held per the events (namespace, hash, group_idx), and every violation of once-and-in-order."""
        held: set[tuple[bytes, bytes, int | None]] = set()
        ever_stored: set[tuple[bytes, bytes, int | None]] = set()
        removed: set[tuple[bytes, bytes, int | None]] = set()
        faults: list[str] = []
        for _, batch in self.batches:
            for ev in batch.events:
                assert ev.medium == E.MEDIUM_DISK and ev.locality == E.LOCAL
                key = (bytes.fromhex(ev.ownership), bytes(ev.block_hashes[0]), ev.group_idx)
                if isinstance(ev, E.BlockStored):
                    if key in ever_stored:
                        faults.append(f"stored twice: {key}")
                    ever_stored.add(key)
                    held.add(key)
                else:
                    if key not in held:
                        faults.append(f"removed while not held: {key}")
                    if key in removed:
                        faults.append(f"removed twice: {key}")
                    removed.add(key)
                    held.discard(key)
        return held, faults

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.ctx.term()


def _store_view(root: Path) -> set[tuple[bytes, bytes, int | None]]:
    index = {name: i for i, (name, _) in enumerate(GROUPS)}
    with DiskStore(str(root), StoreConfig(io_backend="buffered"), readonly=True) as s:
        return {
            (r.key.namespace, r.key.block_hash, index.get(r.key.group))
            for r in s.iter_records(limit=10_000)
            if r.entry is not None and r.entry.state is RecordState.LIVE
        }


def _payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (OBJ,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


def test_subscriber_view_equals_the_store_through_stores_and_cleaner_evictions(tmp_path: Path) -> None:
    ev, replay = f"ipc://{tmp_path}/events.sock", f"ipc://{tmp_path}/replay.sock"
    d = DaemonProc(
        tmp_path,
        verifier='mode = "supervise"\n',
        extra_toml=(
            f'[events]\nendpoint = "{ev}"\nreplay_endpoint = "{replay}"\ntopic = "kvtier-test"\n'
            f"[store.quota_bytes]\ncompressed = {QUOTA}\n"
        ),
    )
    sub = Subscriber(ev, replay)
    try:
        with TierClient(d.socket, VKEY, GROUPS, 4 * OBJ) as c:
            for start in range(0, N, 4):  # the subscriber may join after the first batches: it replays them
                keys = [
                    ObjectKey(VKEY.namespace, i.to_bytes(16, "big"), *GROUPS[i % 2]) for i in range(start, start + 4)
                ]
                deadline = time.monotonic() + 120
                while True:  # over the quota the store refuses the batch until the cleaner has made room
                    try:
                        c.store_many([(k, _payload(i), DIGEST) for i, k in zip(range(start, start + 4), keys)])
                        break
                    except TierFull:
                        assert time.monotonic() < deadline, "the cleaner made no room"
                        time.sleep(0.2)  # polling a condition with a deadline
        deadline = time.monotonic() + 120
        while True:
            sub.drain()
            held, faults = sub.view()
            store = _store_view(tmp_path / "store")
            removed = sum(isinstance(e, E.BlockRemoved) for _, b in sub.batches for e in b.events)
            settled = sum(g == 0 for _, _, g in store) * record_length(OBJ) <= 0.95 * QUOTA  # no eviction due
            if removed and settled and held == store:
                break
            assert time.monotonic() < deadline, f"view {len(held)} vs store {len(store)}, {removed} removed"
            time.sleep(0.2)  # polling a condition with a deadline
        assert not faults, faults
        stored = [e for _, b in sub.batches for e in b.events if isinstance(e, E.BlockStored)]
        assert len(stored) == N  # every object once
        assert {e.group_idx for e in stored} == {0, 1} and all(e.ownership == VKEY.namespace.hex() for e in stored)
        assert len(store) < N  # the cleaner evicted: the compressed group is under its quota
        evicted = {
            (bytes(e.block_hashes[0]), e.group_idx)
            for _, b in sub.batches
            for e in b.events
            if not isinstance(e, E.BlockStored)
        }
        assert evicted and {g for _, g in evicted} == {0}  # only the compressed group was over its quota
        # a subscriber that joins now gets the whole history from the replay socket, batch for batch
        late = Subscriber(ev, replay)
        try:
            late._replay_from(0, sub.next_seq)
            assert [(q, msgspec.msgpack.encode(b)) for q, b in late.batches] == [
                (q, msgspec.msgpack.encode(b)) for q, b in sub.batches
            ]
        finally:
            late.close()
        with Client(d.socket) as c:
            doc = c.stats()
            assert doc.events is not None and doc.events.stored == N and doc.events.removed == len(evicted)
            assert doc.events.batches == sub.next_seq and doc.events.replays >= 1
            while doc.verifier.actions.get("evicted", 0) < len(evicted):  # the verifier publishes its counts later
                assert time.monotonic() < deadline, doc.verifier.actions
                time.sleep(0.2)  # polling a condition with a deadline
                doc = c.stats()
            assert doc.verifier.actions["evicted"] == len(evicted)  # each eviction published once
    finally:
        sub.close()
        d.close()


def test_events_off_by_default_and_bad_keys_are_typed() -> None:
    base = load_config(mode="user", env={}, cwd=Path("/tmp"))
    assert not base.events.enabled
    cfg = config_from_dict({"events": {"endpoint": "tcp://*:5557", "topic": "kv", "buffer_steps": 5}}, base, "t.toml")
    assert cfg.events.enabled and cfg.events.buffer_steps == 5 and cfg.events.replay_endpoint == ""
    for table, key in (
        ({"endpoint": "http://x:1"}, "events.endpoint"),
        ({"endpoint": "tcp://*:5557", "buffer_steps": 0}, "events.buffer_steps"),
        ({"replay_endpoint": "tcp://*:5558"}, "events.replay_endpoint"),
        ({"endpoint": "tcp://*:5557", "topics": "x"}, "events.topics"),
        ({"endpoint": 5557}, "events.endpoint"),
    ):
        with pytest.raises(ConfigError) as err:
            config_from_dict({"events": table}, base, "t.toml")
        assert err.value.key == key and "t.toml" in str(err.value)


def test_an_endpoint_that_cannot_be_bound_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        EventPublisher(EventsConfig(endpoint=f"ipc://{tmp_path}/no/such/dir/ev.sock"))
    assert err.value.key == "events.endpoint" and "cannot bind" in str(err.value)
    first = EventPublisher(EventsConfig(endpoint="tcp://*:0"))  # the kernel picks the port
    try:
        port = first.endpoint.rpartition(":")[2]
        with pytest.raises(ConfigError) as err:
            EventPublisher(EventsConfig(endpoint=f"tcp://*:{port}"))  # taken by the first
        assert err.value.key == "events.endpoint"
    finally:
        first.close()
