"""The daemon serves the store before its pools exist, and an engine-only node (`profiles = []`) never makes any.

Both are observed on a real `kvtier serve`: its stats document (`pools`, `profiles`, `startup`), its metrics, the
shared memory its process holds (/proc/PID/status RssShmem and HugetlbPages: the pools are memfds, their pages taken
when made), and engines' tier ops answered through its socket. The pools' allocation is held back by a FIFO the test
writes to (`KVTIER_HOLD_POOLS`), so "served before the pools were ready" is an order, not a race against the clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from kvtier.client import Client
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.integrations.daemon_store import DaemonStore
from kvtier.wire import Connection
from kvtier.wire.errors import DaemonUnavailable, NoPools
from kvtier.wire.stats import StatsDoc
from support.daemon import DaemonProc, child_env

POOL_BYTES = 32 << 20  # per form: four forms, 128 MiB the pools would take
POOLS = "".join(f'{f} = "{POOL_BYTES >> 20}MiB"\n' for f in ("compressed", "indexer", "tail", "swa"))
ENGINE = VersionKey("engine/test-model", "xxh3_128:test", "engine-abi", "-", "-", "uint8")
GROUPS = [("kv", CacheForm.COMPRESSED), ("window", CacheForm.SWA)]
DIGEST = bytes(range(16))


def shared_held(pid: int) -> int:
    """Shared memory this process holds, in bytes: its shmem pages and its hugetlb pages (a memfd pool takes the
    host's free hugetlb pages where there are any, and RssShmem does not count those)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return sum(int(fields[name].split()[0]) * 1024 for name in ("RssShmem", "HugetlbPages"))


def stats(socket_path: Path, deadline_s: float = 60.0) -> StatsDoc:
    """The daemon's stats document, polling until its socket answers (the store opens before it listens)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with Connection(socket_path, timeout_s=10.0, name="test") as conn:
                return conn.stats()
        except DaemonUnavailable:  # not listening yet
            pass
        assert time.monotonic() < deadline, "the daemon never answered on its socket"
        time.sleep(0.05)  # polling interval of a real condition (the socket answering)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvtier.cli", *args]
    return subprocess.run(cmd, env=child_env(), cwd=cwd, capture_output=True, text=True, timeout=120)


def engine_round_trip(socket_path: Path, seed: int) -> None:
    """What an engine tier does through the daemon: store pages, find them, load them back bitwise; a page never
    stored is a miss."""
    gen = torch.Generator().manual_seed(seed)
    pages = [torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen) for _ in range(3)]
    keys = [ObjectKey(ENGINE.namespace, bytes([seed, i]) * 8, GROUPS[i % 2][0], GROUPS[i % 2][1]) for i in range(3)]
    never = ObjectKey(ENGINE.namespace, bytes([seed, 99]) * 8, "kv", CacheForm.COMPRESSED)
    store = DaemonStore(socket_path, ENGINE, GROUPS, 1 << 20)
    try:
        store.store_many([(k, p, DIGEST) for k, p in zip(keys, pages)])
        assert store.has([*keys, never], [DIGEST] * 4) == [Reason.OK] * 3 + [Reason.MISSING]
        outs = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        assert store.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]) == [Reason.OK] * 3
        assert all(torch.equal(o, p) for o, p in zip(outs, pages))
    finally:
        store.close()


def pool_bytes_metric(address: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kvtier_pool_bytes{"))


def test_serves_the_store_before_its_pools_are_ready(tmp_path: Path) -> None:
    hold = tmp_path / "hold-pools"
    os.mkfifo(hold)
    daemon = DaemonProc(tmp_path, pools=POOLS, env={"KVTIER_HOLD_POOLS": str(hold)}, wait_ready=False, fresh=True)
    attached: list[object] = []
    try:
        doc = stats(daemon.socket)
        assert doc.daemon is not None and doc.daemon.pools == "waiting", doc.daemon
        assert doc.daemon.health.startswith("starting") and doc.profiles == []
        held_before = shared_held(daemon.proc.pid)
        assert held_before < POOL_BYTES  # no pool exists yet

        engine_round_trip(daemon.socket, seed=1)  # engines' lookups, loads and stores: served, store-backed
        st = cli("status", "--socket", str(daemon.socket), cwd=tmp_path)
        assert st.returncode == 5, st.stdout + st.stderr
        assert "pools      starting" in st.stdout
        assert not any("READY=1" in m.split("\n") for m in daemon.messages)

        # kvtier's own client maps the pools at attach: its attach waits for them
        def attach() -> None:
            with Client(daemon.socket, name="early attach") as c:
                attached.append(c.attach("ref-tiny"))
                attached.append(c.lookup(list(range(256))).hit_tokens)

        t = threading.Thread(target=attach)
        t.start()
        with open(hold, "wb") as fifo:  # let the pools allocate
            fifo.write(b"go")
        t.join(60)
        assert not t.is_alive() and len(attached) == 2 and attached[1] == 0, attached
        daemon.wait_for("READY=1", timeout=60)
        doc = stats(daemon.socket)
        assert doc.daemon is not None and doc.daemon.pools == "ready" and doc.daemon.health == "ok"
        assert [p.name for p in doc.profiles] == ["ref-tiny"]
        startup = doc.daemon.startup
        assert startup["listening"] < startup["pools_ready"], startup  # served first, pools after
        assert shared_held(daemon.proc.pid) - held_before >= 4 * POOL_BYTES * 0.9  # the pools' pages, now taken
        assert cli("status", "--socket", str(daemon.socket), cwd=tmp_path).returncode == 0
    finally:
        try:  # after a failed assertion before the release: unblock the pool thread (ENXIO: nobody waits)
            fd = os.open(hold, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"x")
            os.close(fd)
        except OSError:
            pass
        assert daemon.terminate() == 0, daemon.read_log()
    assert "Traceback" not in (tmp_path / "daemon.log").read_text()


def test_engine_only_node_allocates_no_pools(tmp_path: Path) -> None:
    daemon = DaemonProc(tmp_path, pools=POOLS, profiles=(), fresh=True)
    try:
        doc = stats(daemon.socket)
        assert doc.daemon is not None and doc.daemon.pools == "none" and doc.daemon.health == "ok"
        assert doc.profiles == []
        assert shared_held(daemon.proc.pid) < POOL_BYTES  # 128 MiB configured, none of it taken
        assert pool_bytes_metric(doc.daemon.metrics) == 0

        engine_round_trip(daemon.socket, seed=2)
        with Client(daemon.socket, name="kvtier client") as c, pytest.raises(NoPools) as info:
            c.attach("ref-tiny")
        message = str(info.value)
        assert "\n" not in message and "engine-only" in message and "profiles" in message

        st = cli("status", "--socket", str(daemon.socket), cwd=tmp_path)
        assert st.returncode == 0 and "pools      none" in st.stdout, st.stdout + st.stderr
        shown = cli("config", "show", "--config", str(daemon.config), cwd=tmp_path)
        assert shown.returncode == 0 and "engine-only node" in shown.stdout, shown.stderr
        assert "profiles = []" in shown.stdout
    finally:
        assert daemon.terminate() == 0, daemon.read_log()
    assert "Traceback" not in (tmp_path / "daemon.log").read_text()


def test_doctor_says_an_engine_only_node_needs_no_pool_memory(tmp_path: Path) -> None:
    from kvtier.cli.doctor import check_config, check_memory

    cfg_file = tmp_path / "k.toml"
    cfg_file.write_text('profiles = []\n[pool.budget_bytes]\ncompressed = "200GiB"\n')
    first, cfg = check_config(str(cfg_file), "user")
    assert first.status == "ok" and "engine-only" in first.detail
    assert cfg is not None
    memory = check_memory(cfg)
    assert memory.status == "ok" and "no pools" in memory.detail  # a 200 GiB budget is not needed: no pools


def test_a_budget_too_small_for_one_block_is_refused_before_serving(tmp_path: Path) -> None:
    """The pools allocate after the daemon listens, so what would fail there is checked before: one line, exit 2."""
    config = tmp_path / "k.toml"
    config.write_text(
        f'device = "cpu"\nprofiles = ["ref-tiny"]\n[server]\nsocket = "{tmp_path / "k.sock"}"\n'
        f'[store]\nroot = "{tmp_path / "store"}"\n[pool.budget_bytes]\nswa = "1KiB"\n[verifier]\nmode = "off"\n'
        '[metrics]\naddress = ""\n'
    )
    out = cli("serve", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if not ln.startswith("kvtier serve:")]
    assert len(lines) == 1 and "pool.budget_bytes" in lines[0] and "swa" in lines[0], out.stderr
    assert not (tmp_path / "k.sock").exists()
