"""The fault matrix: every fault ends in a bitwise-correct reuse or a RECOMPUTE with the right reason,
never another logit.

Engine A writes through a real daemon; the fault is applied for real (bits flipped in segment files
and in LMDB's data file, segments truncated or deleted, records evicted, namespaces bumped,
processes killed with -9, a filesystem filled); engine B then looks up, loads, restores and
continues, and its logits are compared bitwise with a recompute from the hit it got. Each case adds
a row (case, route, reason, outcome) to the table printed at the end of the run.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.client import Client, NotDurable, OutOfOrder
from kvtier.core.forms import Reason, Route
from kvtier.core.hashing import block_hashes
from kvtier.core.profile import ModelProfile, profile_from_dict
from kvtier.core.tier import ObjectKey
from kvtier.refmodel import RefModel
from kvtier.refmodel.engine import EngineVersionError, RefEngine
from kvtier.store import DiskStore, StoreLimits
from kvtier.store.index import IndexEntry, encode_key
from kvtier.verifier import Verifier, VerifierSettings, open_store
from support.corrupt import flip_payload_bit
from support.daemon import SMALL_POOLS, DaemonProc, wait_leases_released
from support.e2e_harness import PROFILE, H, Oracle, save_prompts, start_engine
from support.fault_cases import BLOCKS, CP, a_prompt, b_prompt, bitwise, file_row, offload, serve
from support.fault_table import FaultRows
from support.mounts import mounted


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """One case: the (group, block) it breaks, the route/reason that object must end with, and the hit B must get."""

    seed: int
    group: str
    block: int
    reason: Reason
    hit_blocks: int


def _keys(tokens: np.ndarray, group: str, block: int) -> ObjectKey:
    hashes = block_hashes(PROFILE.namespace, tokens, H)
    return ObjectKey(PROFILE.namespace, hashes[block], group, PROFILE.group(group).form)


# ---------------------------------------------------------------------------------------------------
# Faults in the disk store, applied while the daemon is down; B runs on a cold pool after the restart.

RECORD_FLIPS = {
    "bit flip in a compressed record": Fault(11, "c4", 9, Reason.CORRUPT, 8),
    "bit flip in an indexer record": Fault(12, "c4_index", 9, Reason.CORRUPT, 8),
    "bit flip in a swa record": Fault(13, "swa", 11, Reason.CORRUPT, 8),
    "bit flip in a tail record": Fault(14, "c16_tail", 11, Reason.CORRUPT, 8),
}
EVICTIONS = {
    "tail evicted by the cleaner": Fault(15, "c4_tail", 11, Reason.EVICTED, 8),
    "one swa block of the window evicted": Fault(16, "swa", 10, Reason.EVICTED, 8),
}
LMDB_FLIP = Fault(17, "c16", 5, Reason.CORRUPT, 4)
TRUNCATED = Fault(18, "c4", 9, Reason.CORRUPT, 8)  # the segment ends inside this record (hit at most 8 blocks)
DELETED = Fault(19, "c4", 0, Reason.MISSING, 0)  # its whole segment is gone


@dataclasses.dataclass(slots=True)
class DiskWorld:
    daemon: DaemonProc
    lookup_hits: dict[int, int]


def _flip_segment_bit(store_root: Path, store: DiskStore, key: ObjectKey) -> None:
    """Flip one bit in the middle of the object's payload in its segment file."""
    flip_payload_bit(store_root, _entry(store, key), 100, 4)


def _entry(store: DiskStore, key: ObjectKey) -> IndexEntry:
    with store.index.read() as txn:
        return IndexEntry.unpack(txn.get(encode_key(key), db=store.index.obj))


def _flip_lmdb_value(store_root: Path, store: DiskStore, key: ObjectKey) -> None:
    """Flip one bit of the object's index value inside LMDB's data file (LMDB does not checksum values)."""
    with store.index.read() as txn:
        raw = bytes(txn.get(encode_key(key), db=store.index.obj))
    path = store_root / "index.lmdb" / "data.mdb"
    data = bytearray(path.read_bytes())
    at = data.find(raw)
    assert at >= 0, "the index value is not in data.mdb"
    while at >= 0:  # the live page, and any stale copy-on-write copies of it
        data[at + len(raw) // 2] ^= 0x01
        at = data.find(raw, at + 1)
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def disk_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DiskWorld]:
    tmp = tmp_path_factory.mktemp("diskfaults")
    root = tmp / "store"
    d = DaemonProc(tmp)
    try:
        offload(d, DELETED.seed)  # alone in the first segment
    finally:
        d.proc.send_signal(signal.SIGKILL)
        d.close()
    d = DaemonProc(tmp)  # a new writer: a new segment
    try:
        seeds = [f.seed for f in (*RECORD_FLIPS.values(), *EVICTIONS.values(), LMDB_FLIP)]
        offload(d, *seeds)
        offload(d, TRUNCATED.seed)  # last: its records are at the tail of the segment
        assert d.terminate() == 0
    finally:
        d.close()
    store = DiskStore(str(root))  # a maintenance process, like the cleaner: the daemon is down
    try:
        for f in RECORD_FLIPS.values():
            _flip_segment_bit(root, store, _keys(a_prompt(f.seed), f.group, f.block))
        for f in EVICTIONS.values():
            assert (
                store.evict([_keys(a_prompt(f.seed), f.group, f.block)]) == 1
            )  # what the cleaner does: a tombstone stays
        _flip_lmdb_value(root, store, _keys(a_prompt(LMDB_FLIP.seed), LMDB_FLIP.group, LMDB_FLIP.block))
        cut = _entry(store, _keys(a_prompt(TRUNCATED.seed), TRUNCATED.group, TRUNCATED.block))
        deleted = _entry(store, _keys(a_prompt(DELETED.seed), DELETED.group, DELETED.block)).segment
        assert deleted != cut.segment
    finally:
        store.close()
    seg = root / "segments"
    with open(seg / f"{cut.segment:016x}.seg", "r+b") as f:
        f.truncate(cut.payload_offset + 100)  # inside the record's payload
    (seg / f"{deleted:016x}.seg").unlink()
    d = DaemonProc(tmp)
    try:
        yield DiskWorld(d, {})
    finally:
        d.close()


DISK_CASES = {
    **RECORD_FLIPS,
    **EVICTIONS,
    "LMDB index value bit-flipped": LMDB_FLIP,
    "truncated segment": TRUNCATED,
    "deleted segment": DELETED,
}


@pytest.mark.parametrize("case", list(DISK_CASES))
def test_disk_fault(case: str, disk_world: DiskWorld, oracle: Oracle, fault_table: FaultRows) -> None:
    f = DISK_CASES[case]
    tokens = b_prompt(f.seed)
    res = serve(disk_world.daemon, tokens)
    cv = res.final_cv
    assert (cv.route(f.group, f.block), cv.reason(f.group, f.block)) == (Route.RECOMPUTE, f.reason), cv.counts()
    if f is TRUNCATED:
        assert res.hit_tokens <= f.hit_blocks * H
    else:
        assert res.hit_tokens == f.hit_blocks * H, (res.hit_tokens, cv.counts())
    if f in (
        *RECORD_FLIPS.values(),
        TRUNCATED,
        DELETED,
    ):  # the index looks fine: caught when the load verifies the bytes
        assert res.lookup_cv.hit_tokens == BLOCKS * H and res.lookups == 2
    else:  # caught at lookup: the record is gone, or its index value fails its seal
        assert res.lookup_cv.hit_tokens == f.hit_blocks * H
    file_row(fault_table, case, res, f.group, f.block, bitwise(res, tokens, oracle))


# ---------------------------------------------------------------------------------------------------
# Version bumps: one daemon serves the old and the new namespaces side by side (a canary).

BUMPS = {
    "compressor version bump": {"compression_version": "ref-compressor/2"},
    "indexer version bump": {"indexer_version": "ref-indexer/2"},
    "kernel ABI bump": {"kernel_abi": "kvtier-ref-torch/2"},
    "weights digest changed, same model id": {"weights_digest": "seed-0-finetuned"},
}


def _bumped(name: str, changes: dict[str, str]) -> ModelProfile:
    doc = PROFILE.to_dict()
    doc["name"] = name
    doc["version"].update(changes)
    return profile_from_dict(doc)


@pytest.fixture(scope="module")
def version_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, dict[str, ModelProfile]]]:
    tmp = tmp_path_factory.mktemp("versions")
    profiles = {case: _bumped(f"ref-tiny-bump{i}", changes) for i, (case, changes) in enumerate(BUMPS.items())}
    paths = []
    for p in profiles.values():
        path = tmp / f"{p.name}.toml"
        path.write_text(p.to_toml())
        paths.append(str(path))
    d = DaemonProc(tmp, profiles=("ref-tiny", *paths))
    try:
        offload(d, 21)
        yield d, profiles
    finally:
        d.close()


@pytest.mark.parametrize("case", list(BUMPS))
def test_version_bump_is_a_new_namespace(case: str, version_world, fault_table: FaultRows) -> None:
    d, profiles = version_world
    profile = profiles[case]
    assert profile.namespace != PROFILE.namespace and profile.version.model_id == PROFILE.version.model_id
    tokens = b_prompt(21)
    with Client(d.socket) as client:  # an engine of the new version on the old namespace is refused outright
        with pytest.raises(OutOfOrder):
            RefEngine(client, RefModel(profile))  # not attached yet
        client.attach(PROFILE.name)
        with pytest.raises(EngineVersionError):
            RefEngine(client, RefModel(profile))
    res = serve(d, tokens, profile)
    cv = res.final_cv
    assert res.hit_tokens == 0 and res.loaded_objects == 0
    assert (cv.routes == Route.RECOMPUTE).all() and (cv.reasons[:, :BLOCKS] == Reason.MISSING).all()
    outcome = bitwise(res, tokens, Oracle(profile))
    old = serve(d, tokens)  # the old namespace is untouched and still served
    assert old.hit_tokens == BLOCKS * H
    file_row(fault_table, case, res, "c4", 0, outcome + "; old namespace still hits")


# ---------------------------------------------------------------------------------------------------
# Processes killed with -9, and a full disk.


def test_daemon_killed_during_an_offload_then_restarted(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    work = tmp_path / "work"
    work.mkdir()
    seeds = list(range(31, 37))
    save_prompts(work, {f"p{s}": a_prompt(s) for s in seeds})
    d = DaemonProc(tmp_path)
    try:
        engine = start_engine(d, work, "offload", *(f"p{s}" for s in seeds))
        acked = json.loads(engine.stdout.readline())  # the first prompt is acknowledged (durable) ...
        d.proc.send_signal(signal.SIGKILL)  # ... and the daemon dies while the engine offloads the next
        d.proc.wait()
        engine.wait(60)
        assert engine.returncode != 0 and "DaemonUnavailable" in engine.stderr.read()
    finally:
        d.close()
    d = DaemonProc(tmp_path)
    try:
        hits = {}
        for s in seeds:
            tokens = b_prompt(s)
            res = serve(d, tokens)
            hits[s] = res.hit_tokens
            outcome = bitwise(res, tokens, oracle)
            if f"p{s}" == acked["name"]:
                assert res.hit_tokens == BLOCKS * H  # acknowledged: nothing lost
                file_row(fault_table, "daemon kill -9 during an offload: acknowledged prompt", res, "c4", 0, outcome)
        unacked = [s for s in seeds if f"p{s}" != acked["name"]]
        in_flight = serve(d, b_prompt(unacked[0]))
        file_row(
            fault_table,
            "daemon kill -9 during an offload: the prompt in flight",
            in_flight,
            "c4",
            BLOCKS - 1,
            bitwise(in_flight, b_prompt(unacked[0]), oracle),
        )
        assert all(hits[s] == 0 for s in unacked[1:])  # never offloaded: misses, not garbage
    finally:
        assert d.terminate() == 0


def test_disk_full_during_an_offload(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    with mounted("tmpfs", 3) as mnt:
        d = DaemonProc(tmp_path, store_root=Path(mnt) / "store")
        try:
            acked, refused = [], None
            with Client(d.socket, name="engine A") as client:
                client.attach(PROFILE.name)
                engine = RefEngine(client, RefModel(PROFILE), checkpoint_every=CP)
                for s in range(41, 80):
                    try:
                        engine.prefill_and_offload(a_prompt(s), durable=True)
                    except NotDurable as exc:
                        assert "not in the store" in str(exc) and "StoreFull" in str(exc)
                        refused = s
                        break
                    acked.append(s)
                assert refused is not None and acked, "the filesystem never filled"
                # serving goes on, but the status says the disk refuses write-back
                assert client.stats().daemon.health.startswith("degraded: write-back blocked")
            d.proc.send_signal(signal.SIGKILL)  # a cold pool: what is served now comes from the full disk
            d.proc.wait()
        finally:
            d.close()
        d = DaemonProc(tmp_path, store_root=Path(mnt) / "store")
        try:
            for s in acked:
                res = serve(d, b_prompt(s))
                assert res.hit_tokens == BLOCKS * H
                bitwise(res, b_prompt(s), oracle)
            res = serve(d, b_prompt(refused))
            assert res.hit_tokens < BLOCKS * H or res.loaded_objects > 0
            group, block = next(
                (
                    (g, b)
                    for b, g, _, r, why in res.final_cv.entries()
                    if r is Route.RECOMPUTE and why is Reason.MISSING
                ),
                ("c4", 0),
            )
            file_row(
                fault_table,
                f"disk full during an offload ({len(acked)} prompts acknowledged first)",
                res,
                group,
                block,
                bitwise(res, b_prompt(refused), oracle) + f"; {len(acked)} acknowledged prompts hit in full",
            )
        finally:
            d.close()


def test_client_killed_while_holding_leases(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    work = tmp_path / "work"
    work.mkdir()
    save_prompts(work, {"held": b_prompt(51)})
    d = DaemonProc(tmp_path, pools=SMALL_POOLS)
    try:
        offload(d, 51)
        holder = start_engine(d, work, "hold", "held")
        held = json.loads(holder.stdout.readline())
        assert held["hit_tokens"] == BLOCKS * H and held["held"] > 0
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        wait_leases_released(d.socket)
        offload(d, *range(52, 58))  # pool pressure: the formerly leased slots may go (to disk: they were persisted)
        tokens = b_prompt(51)
        res = serve(d, tokens)
        assert res.hit_tokens == BLOCKS * H
        file_row(
            fault_table,
            "client killed -9 while holding leases",
            res,
            "c4",
            0,
            bitwise(res, tokens, oracle) + "; leases released",
        )
    finally:
        assert d.terminate() == 0


class _SlowLoader(Client):
    """An engine client that is slow between its lookup and its load; the verifier acts in that window."""

    def __init__(self, *args, between, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.between = between

    def load(self, result):
        self.between()
        return super().load(result)


def test_verifier_evicts_while_engine_b_loads(tmp_path: Path, oracle: Oracle, fault_table: FaultRows) -> None:
    """TOCTOU: B's lookup saw the records (RECOVER); the verifier, its own process-level store handle, evicts them all
    (and reclaims their segment) before B's load: the load finds them gone, nothing stale is read."""
    seed = 61
    d = DaemonProc(tmp_path)
    try:
        offload(d, seed)
        d.proc.send_signal(signal.SIGKILL)  # a cold pool: the restore must load from disk
        d.proc.wait()
    finally:
        d.close()
    d = DaemonProc(tmp_path)
    actions: dict[str, int] = {}
    try:
        with open_store(tmp_path / "store") as store:
            before = store.stats()["records"]

            def evict_all() -> None:
                if not actions:
                    settings = VerifierSettings(
                        limits=StoreLimits(budget_bytes=1, form_quotas=()), rate_bytes_per_s=0, evict_low=0.0
                    )
                    actions.update(Verifier(store, settings).run_once())

            with _SlowLoader(d.socket, name="engine B", between=evict_all) as client:
                client.attach(PROFILE.name)
                tokens = b_prompt(seed)
                res = RefEngine(client, RefModel(PROFILE), checkpoint_every=CP).restore_and_continue(tokens)
            assert store.stats()["records"] == 0 < before
        assert actions.get("evicted", 0) == before, actions
        assert res.lookup_cv.hit_tokens == BLOCKS * H and res.loaded_objects == 0
        cv = res.final_cv
        assert res.hit_tokens == 0 and (cv.route("c4", 0), cv.reason("c4", 0)) == (Route.RECOMPUTE, Reason.EVICTED)
        file_row(
            fault_table,
            "verifier evicts between B's lookup and load (TOCTOU)",
            res,
            "c4",
            0,
            bitwise(res, tokens, oracle) + f"; {before} records evicted under B",
        )
    finally:
        d.close()
