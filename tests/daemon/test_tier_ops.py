"""The raw tier ops (tier_open / tier_has / tier_store / tier_load) against a real daemon subprocess.

A client with its own keys and namespace stores through the daemon in one process and loads in another;
a flipped bit on disk is CORRUPT and never reaches the caller's buffer; bad requests get typed error
frames and the daemon keeps serving.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier import wire as P
from kvtier.client import BadRange, Client, OutOfOrder, TierClient
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.integrations.daemon_store import DaemonStore
from kvtier.store import DiskStore
from kvtier.wire.errors import DaemonUnavailable, WrongType
from support.corrupt import flip_payload_bit
from support.daemon import DaemonProc, child_env

VKEY = VersionKey("test/engine", "xxh3_128:00", "test-abi", "none", "none", "bf16;chunk=4096")
GROUPS = [("eng.g0.full", CacheForm.COMPRESSED), ("eng.g1.swa", CacheForm.SWA)]
GROUPS_WIRE = [(g, f.value) for g, f in GROUPS]
DIGEST = bytes(range(16))
OBJ = 4096
N = 6


def _key(i: int, group: int = 0) -> ObjectKey:
    name, form = GROUPS[group]
    return ObjectKey(VKEY.namespace, i.to_bytes(16, "little"), name, form)


def _payload(i: int) -> torch.Tensor:
    return torch.randint(0, 256, (OBJ,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))


# Runs in its own process: store N objects (in batches of 2: a staging region of 2 objects) and exit.
_STORE = """
import json, sys
import torch
from kvtier.client import TierClient
from kvtier.core.forms import CacheForm
from kvtier.core.tier import ObjectKey
from kvtier.core.versions import VersionKey
vkey = VersionKey.from_dict(json.loads(sys.argv[2]))
groups = [(g, CacheForm(f)) for g, f in json.loads(sys.argv[3])]
obj, n, digest = int(sys.argv[4]), int(sys.argv[5]), bytes(range(16))
keys = [ObjectKey(vkey.namespace, i.to_bytes(16, "little"), *groups[0]) for i in range(n)]
payloads = [
        torch.randint(0, 256, (obj,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)) for i in range(n)
    ]
with TierClient(sys.argv[1], vkey, groups, 2 * obj) as c:
    c.store_many(list(zip(keys, payloads, [digest] * n)))
    print(sum(r.value == 0 for r in c.has(keys, [digest] * n)))
"""


@pytest.fixture(scope="module")
def tier_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    d = DaemonProc(tmp_path_factory.mktemp("tier"))
    yield d
    d.close()


@pytest.fixture(scope="module")
def stored(tier_daemon: DaemonProc) -> DaemonProc:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _STORE,
            str(tier_daemon.socket),
            json.dumps(VKEY.to_dict()),
            json.dumps(GROUPS_WIRE),
            str(OBJ),
            str(N),
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(N)  # the storing process saw all of them committed
    return tier_daemon


def _flip(store_root: Path, key: ObjectKey) -> None:
    with DiskStore(str(store_root), readonly=True) as s:
        (info,) = s.records([key])
    flip_payload_bit(store_root, info.entry, info.entry.payload_len // 3, 2)


def test_store_in_one_process_load_in_another(stored: DaemonProc) -> None:
    with TierClient(stored.socket, VKEY, GROUPS, 3 * OBJ) as c:
        assert c.namespace == VKEY.namespace
        keys = [_key(i) for i in range(N)] + [_key(99), _key(0, group=1)]
        assert c.has(keys, [DIGEST] * len(keys)) == [Reason.OK] * N + [Reason.MISSING] * 2
        assert c.has([_key(0)], [bytes(16)]) == [Reason.ABI_MISMATCH]
        live, after = [], b""  # the namespace's live keys, in pages of 4 (what an engine tier keeps in memory)
        while True:
            page = c.live_keys(after, limit=4)
            live += page.keys
            if not (after := page.cursor):
                break
        assert sorted(live) == sorted((_key(i).block_hash, GROUPS[0][0]) for i in range(N))
        assert c.live_keys(limit=0).txn == page.txn  # nothing committed since: the same index snapshot
        outs = [torch.zeros(OBJ, dtype=torch.uint8) for _ in keys]
        reasons = c.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)])  # 3 staging batches
        assert reasons == [Reason.OK] * N + [Reason.MISSING] * 2
        for i in range(N):
            assert torch.equal(outs[i], _payload(i))
        assert not outs[N].any() and not outs[N + 1].any()
        # a typed non-uint8 destination gets the same bytes
        typed = torch.zeros(OBJ // 2, dtype=torch.bfloat16)
        assert c.load_into([LoadRequest(_key(2), typed, DIGEST)]) == [Reason.OK]
        assert torch.equal(typed.view(torch.uint8), _payload(2))


def test_a_corrupt_record_is_corrupt_and_leaves_the_destination_untouched(stored: DaemonProc, tmp_path: Path) -> None:
    store_root = stored.tmp / "store"
    victim = _key(N - 1)
    _flip(store_root, victim)
    with TierClient(stored.socket, VKEY, GROUPS, 4 * OBJ) as c:
        outs = [torch.full((OBJ,), 0xA5, dtype=torch.uint8) for _ in range(2)]
        reasons = c.load_into([LoadRequest(_key(0), outs[0], DIGEST), LoadRequest(victim, outs[1], DIGEST)])
        assert reasons == [Reason.OK, Reason.CORRUPT]
        assert torch.equal(outs[0], _payload(0))
        assert bool((outs[1] == 0xA5).all())  # the daemon read into staging; nothing unverified was copied out
        assert c.has([victim], [DIGEST]) == [Reason.CORRUPT]  # quarantined: a miss from now on
        # storing it again repoints the key to a fresh record (records are immutable)
        c.store_many([(victim, _payload(N - 1), DIGEST)])
        again = torch.zeros(OBJ, dtype=torch.uint8)
        assert c.load_into([LoadRequest(victim, again, DIGEST)]) == [Reason.OK] and torch.equal(again, _payload(N - 1))


def test_bad_ranges_and_out_of_order_get_typed_errors(tier_daemon: DaemonProc) -> None:
    with TierClient(tier_daemon.socket, VKEY, GROUPS, 2 * OBJ) as c:
        for offset, nbytes in [(OBJ, 2 * OBJ), (-1, 16), (0, 0), (2 * OBJ, 1), (2**62, 2**62)]:
            with pytest.raises(BadRange):
                c.load_staged([P.TierItem(_key(0).block_hash, 0, DIGEST, offset, nbytes)])
            with pytest.raises(BadRange):
                c.store_staged([P.TierItem(_key(50).block_hash, 0, DIGEST, offset, nbytes)])
        with pytest.raises(WrongType):
            c.load_staged([P.TierItem(_key(0).block_hash, 7, DIGEST, 0, OBJ)])  # no such group index
        with pytest.raises(WrongType):
            c._call(P.TierHas([P.TierItem(b"short", 0, DIGEST)]))
        with pytest.raises(OutOfOrder):
            c._call(P.TierOpen(VKEY.to_dict(), [("x", "swa")]))  # one namespace per connection
        with pytest.raises(WrongType, match="limit"):
            c.live_keys(limit=1 << 20)
        with pytest.raises(WrongType, match="cursor of this namespace"):
            c.live_keys(b"\xff" * 40)
        with pytest.raises(WrongType):  # a key of another namespace never reaches the daemon under this one
            c.has([ObjectKey(bytes(16), bytes(16), GROUPS[0][0], GROUPS[0][1])], [DIGEST])
        # the connection still serves, and nothing was stored by the refused requests
        assert c.has([_key(50)], [DIGEST]) == [Reason.MISSING]
    with Client(tier_daemon.socket) as plain:
        with pytest.raises(OutOfOrder):
            plain._call(P.TierHas([]))  # before tier_open
        for bad in (
            P.TierOpen({"model_id": "m"}, [("g", "swa")]),  # incomplete version key
            P.TierOpen(VKEY.to_dict(), [("g", "on_disk")]),  # a residence, not a form
            P.TierOpen(VKEY.to_dict(), [("g", "swa"), ("g", "tail")]),  # duplicate group
            P.TierOpen(VKEY.to_dict(), []),
            P.TierOpen(VKEY.to_dict(), [("g", "swa")], staging_bytes=4096),  # staging without its memfd
        ):
            with pytest.raises(WrongType):
                plain._call(bad)
        assert plain.stats().daemon.health == "ok"
    assert tier_daemon.proc.poll() is None


def test_staging_must_be_a_sealed_read_write_memfd(tier_daemon: DaemonProc) -> None:
    """An unsealed memfd could be shrunk under the daemon's mapping (SIGBUS): refused, as is a read-only descriptor."""
    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, OBJ)
    sealed = os.memfd_create("sealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(sealed, OBJ)
    fcntl.fcntl(sealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    readonly = os.open(f"/proc/self/fd/{sealed}", os.O_RDONLY)
    try:
        for fd, size in [(unsealed, OBJ), (readonly, OBJ), (sealed, 2 * OBJ)]:
            with Client(tier_daemon.socket) as c, pytest.raises(WrongType):
                c._call(P.TierOpen(VKEY.to_dict(), GROUPS_WIRE, size), send_fds=[fd])
        with Client(tier_daemon.socket) as c:  # the same sealed memfd, right size: accepted and shared
            reply = c._call(P.TierOpen(VKEY.to_dict(), GROUPS_WIRE, OBJ), send_fds=[sealed])
            assert isinstance(reply, P.TierOpenOk) and reply.namespace == VKEY.namespace
            view = mmap.mmap(sealed, OBJ)
            view[:OBJ] = _payload(77).numpy().tobytes()
            assert c._call(P.TierStore([P.TierItem(_key(77).block_hash, 0, DIGEST, 0, OBJ)])).stored == 1
            view[:OBJ] = bytes(OBJ)
            assert c._call(P.TierLoad([P.TierItem(_key(77).block_hash, 0, DIGEST, 0, OBJ)])).reasons == bytes(
                [Reason.OK]
            )
            assert view[:OBJ] == _payload(77).numpy().tobytes()  # the daemon wrote the verified bytes into our memory
            view.close()
    finally:
        for fd in (unsealed, sealed, readonly):
            os.close(fd)
    assert tier_daemon.proc.poll() is None


def test_descriptors_sent_with_other_ops_are_not_kept(tier_daemon: DaemonProc) -> None:
    """A descriptor riding along with any request is closed by the daemon once that request is answered."""
    fds = f"/proc/{tier_daemon.proc.pid}/fd"
    r, w = os.pipe()
    try:
        with Client(tier_daemon.socket) as c:
            c.stats()
            before = len(os.listdir(fds))
            for _ in range(20):
                c._call(P.Stats(), send_fds=[r, w])
            c.stats()
            assert len(os.listdir(fds)) <= before + 1  # not 40 leaked pipe ends
    finally:
        os.close(r)
        os.close(w)


def test_an_engine_tier_store_through_the_daemon_and_the_daemon_going_away(tmp_path: Path) -> None:
    """`DaemonStore` (what the vLLM tier uses with daemon_socket): stores, lookups and loads on their own connections;
    once the daemon is gone every call is a typed DaemonUnavailable (the tier fails the job: vLLM recomputes)."""
    d = DaemonProc(tmp_path)
    try:
        ds = DaemonStore(d.socket, VKEY, GROUPS, 2 * OBJ)
        keys = [_key(100 + i) for i in range(3)]
        ds.store_many([(k, _payload(100 + i), DIGEST) for i, k in enumerate(keys)])  # two staging batches
        assert ds.has(keys, [DIGEST] * 3) == [Reason.OK] * 3
        out = torch.zeros(OBJ, dtype=torch.uint8)
        assert ds.load_into([LoadRequest(keys[2], out, DIGEST)]) == [Reason.OK] and torch.equal(out, _payload(102))
        d.proc.kill()
        d.proc.wait()
        with pytest.raises(DaemonUnavailable):
            ds.has(keys, [DIGEST] * 3)
        with pytest.raises(DaemonUnavailable):
            ds.load_into([LoadRequest(keys[0], out, DIGEST)])
        assert torch.equal(out, _payload(102))  # untouched
        ds.close()
    finally:
        d.close()
