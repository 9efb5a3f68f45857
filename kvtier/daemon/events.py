"""The daemon's KV-events publisher: the blocks it holds, stored and removed, on local disk and in the cluster.

Sent as vLLM's `ZmqEventPublisher` sends them, so a KV-aware router that subscribes to vLLM engines subscribes to
kvtier the same way (docs/events.md):

- a PUB socket sends each batch as three frames: the topic, the batch's sequence number (8 bytes, big-endian,
  from 0, one per batch), and the msgpack `KVEventBatch` (`kvtier.daemon.kv_events`);
- a ROUTER socket (optional) answers a request [b"", start sequence as 8 bytes big-endian] with every batch
  still buffered from that sequence on, each as [b"", topic, seq, payload], then [b"", b"", -1 as 8 bytes, b""].

What goes out comes from the store itself: the disk store tells the publisher of every commit that changed which
keys it serves (`DiskStore.observe`), in commit order: a write, a drop or eviction (the verifier's cleaner
decides those in its own process; they are published when the daemon applies them), a quarantine. The cluster's
copies are published when a write-through or a removal returns (`ObservedCluster`).

The sockets are used by the publisher thread only (ZeroMQ sockets are not thread-safe); callers hand it batches
through a bounded queue and never wait on a subscriber. A full queue drops the batch and counts it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import zmq

from kvtier.core.errors import ConfigError
from kvtier.core.events_config import EventsConfig
from kvtier.core.tier import ObjectKey
from kvtier.daemon import kv_events as E
from kvtier.store import DiskStore
from kvtier.wire.stats import EventStats

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the thread waits for a batch before it looks at the replay socket again


class EventPublisher:
    """Bind (or connect) the sockets at once, so a bad endpoint stops the daemon's start; publish on a thread."""

    def __init__(self, cfg: EventsConfig) -> None:
        self.cfg = cfg
        self._ctx = zmq.Context()
        self._pub: zmq.Socket = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(cfg.hwm)
            self.endpoint = _attach(self._pub, cfg.endpoint, "events.endpoint")
            self.replay_endpoint = ""
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _attach(self._replay, cfg.replay_endpoint, "events.replay_endpoint", bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._topic = cfg.topic.encode()
        self._queue: queue.Queue[E.KVEventBatch | None] = queue.Queue(maxsize=cfg.max_queue)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=cfg.buffer_steps)
        self._seq = itertools.count()
        self._groups: dict[bytes, dict[str, int]] = {}
        self._counts = collections.Counter[str]()
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvtier-events", daemon=True)
        self._thread.start()
        log.info(
            "KV events on %s (topic %r)%s",
            self.endpoint,
            cfg.topic,
            f", replays on {self.replay_endpoint}" if self.replay_endpoint else "",
        )

    # -- what a block is called -------------------------------------------------------------------------

    def name_groups(self, namespace: bytes, groups: Iterable[str]) -> None:
        """The order an engine (or a profile) gave its groups in: an event's `group_idx` is the position there."""
        self._groups[namespace] = {g: i for i, g in enumerate(groups)}

    def _group_idx(self, key: ObjectKey) -> int | None:
        return self._groups.get(key.namespace, {}).get(key.group)

    # -- publishing ---------------------------------------------------------------------------------------

    def disk_changed(self, change: str, keys: list[ObjectKey]) -> None:
        """The store's observer: a commit made `keys` servable ("stored") or took them out ("removed")."""
        self.publish(change, keys, E.MEDIUM_DISK, E.LOCAL)

    def publish(self, change: str, keys: Sequence[ObjectKey], medium: str, locality: str) -> None:
        """One batch: an event per key, in the order given. Never blocks: a full queue drops it (counted).

        `data_parallel_rank` 0, as vLLM's publisher fills it in for an engine without data parallelism: the
        daemon is one publisher per node, and subscribers that read the rank find the field there."""
        if not keys or not self._running:
            return
        make = E.stored if change == "stored" else E.removed
        events: list[E.BlockStored | E.BlockRemoved | E.AllBlocksCleared] = [
            make(k.block_hash, medium, locality, k.namespace, self._group_idx(k)) for k in keys
        ]
        try:
            self._queue.put_nowait(E.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        except queue.Full:
            with self._lock:
                self._counts["dropped"] += len(events)
            log.warning("KV events: queue full (%d batches): %d events dropped", self.cfg.max_queue, len(events))

    def stats(self) -> EventStats:
        with self._lock:
            c = dict(self._counts)
        return EventStats(
            self.endpoint,
            self.replay_endpoint,
            self.cfg.topic,
            c.get("batches", 0),
            c.get("stored", 0),
            c.get("removed", 0),
            c.get("dropped", 0),
            c.get("replays", 0),
        )

    # -- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except zmq.ZMQError as exc:  # a replay is best effort; the live stream goes on
                    log.warning("KV events: a replay request failed: %s", exc)
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = E.encode_batch(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:  # the sequence number is spent: a subscriber sees the gap and replays
                log.warning("KV events: batch %d not sent: %s", seq, exc)
            self._buffer.append((seq, payload))
            with self._lock:
                self._counts["batches"] += 1
                self._counts["stored" if isinstance(batch.events[0], E.BlockStored) else "removed"] += len(batch.events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request has %d frames, not 3 (identity, empty, start seq)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        with self._lock:  # counted before the end frame: a subscriber that has its replay finds it in `stats`
            self._counts["replays"] += 1
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), then close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def _attach(sock: zmq.Socket, endpoint: str, key: str, *, bind: bool = False) -> str:
    """Bind a wildcard, ipc or inproc endpoint and connect to any other, as vLLM's publisher does; returns the
    endpoint bound (a tcp port 0 is the one the kernel chose)."""
    bind = bind or "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    try:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot {'bind' if bind else 'connect'} {endpoint}: {exc}; pick another", key=key) from None
    return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))


def start_events(cfg: EventsConfig, store: DiskStore) -> EventPublisher | None:
    """The publisher `[events]` asks for, observing `store`; None when events are off."""
    if not cfg.enabled:
        return None
    events = EventPublisher(cfg)
    store.observe(events.disk_changed)
    return events


def stop_events(events: EventPublisher | None, store: DiskStore) -> None:
    if events is not None:
        store.observe(None)
        events.close()


class ObservedCluster:
    """The cluster tier with its writes and removals published (medium kvtier_cluster): a write-through once
    the cluster stored every object of it, a removal once it returned. Everything else passes through."""

    def __init__(self, cluster: Any, events: EventPublisher) -> None:
        self._cluster = cluster
        self._events = events

    def store_many(self, items: Sequence[tuple[ObjectKey, Any, bytes]]) -> None:
        self._cluster.store_many(items)  # raises when any object was refused: then none is announced
        self._events.publish("stored", [k for k, _, _ in items], E.MEDIUM_CLUSTER, E.REMOTE)

    def store(self, key: ObjectKey, payload: Any, layout_digest: bytes) -> None:
        self.store_many([(key, payload, layout_digest)])

    def remove(self, keys: Sequence[ObjectKey]) -> int:
        n = self._cluster.remove(keys)
        self._events.publish("removed", list(keys), E.MEDIUM_CLUSTER, E.REMOTE)  # none of them is there now
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cluster, name)
