"""Helpers for the verifier tests: real stores with known contents, fault injection, the CLI as a subprocess."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
import xxhash

from kvtier.cli.main import main
from kvtier.core import CacheForm, VersionKey
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.store import DiskStore, IndexEntry, RecordState, StoreConfig
from support.corrupt import segment_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGEST = b"L" * 16
VK = VersionKey("verifier-test", "w0", "abi-1", "comp-1", "idx-1", "fp8-packed")
VK_OLD = VK.bumped(weights_digest="w-old")
GROUPS = {CacheForm.COMPRESSED: "c4", CacheForm.INDEXER: "c4_index", CacheForm.SWA: "swa", CacheForm.TAIL: "c4_tail"}


@dataclasses.dataclass(frozen=True, slots=True)
class Rec:
    key: ObjectKey
    tag: str
    size: int

    def payload(self) -> torch.Tensor:
        return payload(self.tag, self.size)


def payload(tag: str, nbytes: int) -> torch.Tensor:
    seed = xxhash.xxh3_64_intdigest(tag.encode())
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def key(ns: bytes, tag: str, form: CacheForm) -> ObjectKey:
    return ObjectKey(ns, xxhash.xxh3_128_digest(tag.encode()), GROUPS[form], form)


def populate(
    root: str,
    specs: Iterable[tuple[VersionKey, str, CacheForm, int]],
    *,
    segment_bytes: int = 256 << 10,
    budget_bytes: int = 0,
    quotas: dict[CacheForm, int] | None = None,
) -> list[Rec]:
    """Write records as the daemon would (writer role); publishes `budget_bytes`/`quotas` as the writer's limits."""
    recs = []
    config = StoreConfig(segment_bytes=segment_bytes, io_threads=2)
    with DiskStore(root, config, writer=True) as s:
        for vk, tag, form, size in specs:
            ns = s.register_namespace(vk)
            rec = Rec(key(ns, tag, form), tag, size)
            s.store(rec.key, rec.payload(), DIGEST)
            recs.append(rec)
        s.set_limits(budget_bytes, quotas or {})
    return recs


def entries(store: DiskStore) -> dict[ObjectKey, IndexEntry]:
    out, after = {}, None
    while rows := store.iter_records(after=after, limit=512):
        after = rows[-1].key
        out.update({r.key: r.entry for r in rows})
    return out


def age(path: str, seconds: float = 3600.0) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def load(store: DiskStore, recs: list[Rec]) -> list[tuple[object, bool]]:
    """(reason, bytes-correct-or-untouched) per record: a failed load must leave the slot as it was."""
    outs = [torch.full((r.size,), 0xAA, dtype=torch.uint8) for r in recs]
    reasons = store.load_into([LoadRequest(r.key, o, DIGEST) for r, o in zip(recs, outs)])
    return [
        (why, torch.equal(o, r.payload()) if why.name == "OK" else bool((o == 0xAA).all()))
        for why, r, o in zip(reasons, recs, outs)
    ]


def assert_consistent(root: str) -> None:
    """Index invariants a crash must not break: usage and per-segment references equal the sum of the entries."""
    with DiskStore(root, StoreConfig(io_backend="buffered"), readonly=True) as s:
        es = entries(s)
        stats = s.stats()
        segs = s.segments()
    usage: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    refs: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0])
    for k, e in es.items():
        assert e is not None, f"corrupt index value for {k}"
        usage[e.form.value][0] += 1
        usage[e.form.value][1] += e.record_len
        if e.record_len:
            refs[e.segment][0] += 1
            refs[e.segment][1] += e.record_len
            assert e.segment in segs, f"{k} names segment {e.segment:x} with no seg entry"
            if e.state is RecordState.LIVE:
                assert os.path.getsize(segment_path(root, e.segment)) >= e.offset + e.record_len
    for form, f in stats["forms"].items():
        assert [f["records"], f["record_bytes"]] == usage.get(form, [0, 0]), form
    for seg_id, seg in segs.items():
        assert [seg.records, seg.referenced] == refs.get(seg_id, [0, 0]), f"segment {seg_id:x}"


def cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def main_inprocess(capsys, *args: str) -> tuple[int, str, str]:
    """The real `kvtier` entry point, in this process (no torch import per call): (exit code, stdout, stderr)."""
    capsys.readouterr()
    argv = sys.argv
    sys.argv = ["kvtier", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return code, out.out, out.err


def audit_json(capsys, root: str, *flags: str) -> tuple[int, dict]:
    code, out, err = main_inprocess(capsys, "audit", "--store", root, "--json", *flags)
    assert code in (0, 1), err
    assert err == "", "--json prints no progress bar"
    return code, json.loads(out)


FAST = ("--poll", "0.05", "--maintenance-interval", "0.2", "--sweep-interval", "0.5", "--orphan-grace", "60")


def start_verifier(root: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "-v", "verifier", "run", "--store", root, *FAST, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


def stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> str:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def wait_for(
    cond: Callable[[], object], timeout: float, proc: subprocess.Popen[str] | None = None, what: str = ""
) -> object:
    """Poll a real condition until it holds (returns its value) or the deadline passes (fails with `what`)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(
                f"verifier exited ({proc.returncode}) before: {what}\n{proc.stderr.read() if proc.stderr else ''}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for: {what}")
        time.sleep(0.05)  # polling interval of a real condition, not synchronisation


def totals(doc: dict, field: str, *, live: bool | None = None) -> int:
    return sum(c[field] for n in doc["namespaces"] if live is None or n["live"] == live for c in n["forms"].values())
