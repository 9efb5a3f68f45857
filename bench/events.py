"""The cost of KV events on the store's write path: store_many with the events publisher observing the store vs
the same store with nobody observing it, in the same run; prints one JSON object.

Each round stores `--batches` batches of `--objects` x `--object-bytes` (new keys each time) into a fresh store,
alternating off / on so both see the same machine state; the best round of each counts. With events on, a
subscriber on an ipc endpoint receives every batch, and the run checks it got one event per object stored.
`ratio` = on seconds / off seconds (1.0: no cost), with both figures beside it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch
import zmq

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from kvtier.core.events_config import EventsConfig
from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.daemon import kv_events as E
from kvtier.daemon.events import EventPublisher
from kvtier.store import DiskStore, StoreConfig

VK = VersionKey("bench/events", "w0", "abi", "none", "none", "bf16")
DIGEST = bytes(16)


def _round(root: pathlib.Path, args: argparse.Namespace, events: bool, payload: torch.Tensor) -> dict:
    store = DiskStore(str(root), StoreConfig(io_backend=args.io_backend), writer=True)
    store.register_namespace(VK)
    pub = ctx = sub = None
    if events:
        pub = EventPublisher(EventsConfig(endpoint=f"ipc://{root}/events.sock"))
        store.observe(pub.disk_changed)
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        time.sleep(0.2)  # the subscription reaches the PUB socket before the first batch (a bench, not a test)
    try:
        seconds = 0.0
        for b in range(args.batches):
            items = [
                (
                    ObjectKey(VK.namespace, (b * args.objects + i).to_bytes(16, "big"), "g", CacheForm.COMPRESSED),
                    payload,
                    DIGEST,
                )
                for i in range(args.objects)
            ]
            started = time.perf_counter()
            store.store_many(items)
            seconds += time.perf_counter() - started
        received = 0
        if sub is not None:
            deadline = time.monotonic() + 30
            while received < args.batches * args.objects and time.monotonic() < deadline:
                if sub.poll(200):
                    received += len(E.decode_batch(sub.recv_multipart()[2]).events)
        return {"seconds": seconds, "events_received": received}
    finally:
        if pub is not None:
            store.observe(None)
            pub.close()
        if sub is not None:
            sub.close(linger=0)
            ctx.term()  # type: ignore[union-attr]
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--objects", type=int, default=256)
    ap.add_argument("--object-bytes", type=int, default=16384)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--io-backend", default="buffered")
    args = ap.parse_args()
    payload = torch.randint(0, 256, (args.object_bytes,), dtype=torch.uint8)
    best = {"off": float("inf"), "on": float("inf")}
    received = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("off", "on"):
                out = _round(pathlib.Path(tmp) / f"{mode}{r}", args, mode == "on", payload)
                best[mode] = min(best[mode], out["seconds"])
                if mode == "on":
                    received.append(out["events_received"])
    n = args.batches * args.objects
    print(
        json.dumps(
            {
                "objects_per_round": n,
                "object_bytes": args.object_bytes,
                "io_backend": args.io_backend,
                "off_seconds": round(best["off"], 4),
                "on_seconds": round(best["on"], 4),
                "ratio": round(best["on"] / best["off"], 3),
                "off_objects_per_s": round(n / best["off"]),
                "on_objects_per_s": round(n / best["on"]),
                "events_received_per_round": received,
                "all_events_received": all(x == n for x in received),
            }
        )
    )


if __name__ == "__main__":
    main()
