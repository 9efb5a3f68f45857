"""A restarted daemon answers engines' lookups before torch is loaded: torch is imported behind serving.

Importing torch costs seconds of CPU, more than the rest of a start together. The serving path (the CLI's
`serve`, the socket server, the wire, the config, the store and its LMDB index, the engine tier ops) imports none
of it; the pool thread does, once the daemon listens. Observed two ways:

- in a fresh interpreter, importing the serving path's modules leaves `torch` out of `sys.modules`;
- on a real `kvtier serve` whose torch import is held back by a FIFO the test writes to (`KVTIER_HOLD_TORCH`),
  an engine's lookup of records already in the store is answered (hits and a miss, by the daemon's index) while
  the daemon's process has mapped no libtorch (/proc/PID/maps, the kernel's word); released, the same records load
  back bitwise and the pools come up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.cli.guards import check_pool_slots
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.core.forms import CacheForm, Reason
from kvtier.core.layout import slot_stride
from kvtier.core.profile import load_profile
from kvtier.core.tier import LoadRequest, ObjectKey
from kvtier.core.versions import VersionKey
from kvtier.gpu.errors import BudgetError
from kvtier.gpu.slots import _slots_per_form
from kvtier.integrations.daemon_store import DaemonStore
from kvtier.store import DiskStore
from kvtier.wire import Connection
from kvtier.wire.errors import DaemonUnavailable
from kvtier.wire.stats import DaemonInfo
from support.daemon import DaemonProc, child_env

# what `kvtier serve` imports before it listens and answers a lookup
SERVING_PATH = (
    "kvtier.cli.main",
    "kvtier.cli.daemon_cmds",
    "kvtier.cli.guards",
    "kvtier.core.config",
    "kvtier.core.tier",
    "kvtier.wire",
    "kvtier.store",
    "kvtier.daemon.server",
    "kvtier.daemon.service",
    "kvtier.daemon.backend",
    "kvtier.daemon.tier_ops",
    "kvtier.daemon.pool_start",
    "kvtier.daemon.runtime",
)
ENGINE = VersionKey("engine/test-model", "xxh3_128:test", "engine-abi", "-", "-", "uint8")
GROUPS = [("kv", CacheForm.COMPRESSED), ("window", CacheForm.SWA)]
DIGEST = bytes(range(16))


def test_the_serving_path_imports_no_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {SERVING_PATH!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout  # not one torch module: a type-only use sits under TYPE_CHECKING


def torch_mapped(pid: int) -> bool:
    """Whether the process has torch's native library mapped (what `import torch` loads first)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def release(fifo: Path) -> None:
    """Let a held thread go (ENXIO when nobody waits on the FIFO any more: nothing to do)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def test_a_lookup_is_answered_while_torch_is_still_held_back(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(41)
    pages = [torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen) for _ in range(4)]
    keys = [ObjectKey(ENGINE.namespace, bytes([41, i]) * 8, *GROUPS[i % 2]) for i in range(4)]
    never = ObjectKey(ENGINE.namespace, bytes([41, 99]) * 8, *GROUPS[0])
    with DiskStore(str(tmp_path / "store"), writer=True) as store:  # what an earlier daemon left: a restart
        store.register_namespace(ENGINE)
        store.store_many([(k, p, DIGEST) for k, p in zip(keys, pages)])

    hold = tmp_path / "hold-torch"
    os.mkfifo(hold)
    daemon = DaemonProc(tmp_path, env={"KVTIER_HOLD_TORCH": str(hold)}, wait_ready=False, fresh=True)
    engine: DaemonStore | None = None
    try:
        engine = connect(daemon, 60.0)
        assert engine.has([*keys, never], [DIGEST] * 5) == [Reason.OK] * 4 + [Reason.MISSING]
        assert daemon.proc.poll() is None and not torch_mapped(daemon.proc.pid)  # answered without torch
        doc = daemon_info(daemon)
        assert doc.pools == "waiting" and doc.health.startswith("starting")
        assert "listening" in doc.startup and "torch_loaded" not in doc.startup, doc.startup
        assert not any("READY=1" in m.split("\n") for m in daemon.messages)

        release(hold)
        daemon.wait_for("READY=1", timeout=120)  # torch loaded, then the pools allocated
        assert torch_mapped(daemon.proc.pid)
        outs = [torch.zeros(4096, dtype=torch.uint8) for _ in keys]
        assert engine.load_into([LoadRequest(k, o, DIGEST) for k, o in zip(keys, outs)]) == [Reason.OK] * 4
        assert all(torch.equal(o, p) for o, p in zip(outs, pages))
        startup = daemon_info(daemon).startup
        assert startup["listening"] < startup["torch_loaded"] <= startup["pools_ready"], startup
    finally:
        if engine is not None:
            engine.close()
        release(hold)
        assert daemon.terminate() == 0, daemon.read_log()
    assert "Traceback" not in (tmp_path / "daemon.log").read_text()


def test_sigterm_while_torch_is_still_loading_exits_without_waiting_for_it(tmp_path: Path) -> None:
    """The pool thread is held inside its warm-up for the whole test: SIGTERM ends the daemon cleanly well before
    its `shutdown_timeout_s` of 20 s (the old close joined that thread for all of it)."""
    hold = tmp_path / "hold-torch"
    os.mkfifo(hold)
    # (a fresh interpreter: torch must still be loading; shutdown_timeout_s is 20)
    daemon = DaemonProc(tmp_path, env={"KVTIER_HOLD_TORCH": str(hold)}, wait_ready=False, fresh=True)
    try:
        connect(daemon, 60.0).close()  # listening, the warm-up held
        assert "torch_loaded" not in daemon_info(daemon).startup
        t0 = time.monotonic()
        assert daemon.terminate(timeout=45) == 0, daemon.read_log()
        assert time.monotonic() - t0 < 12, "SIGTERM waited for the held warm-up"
    finally:
        release(hold)
        daemon.close()


def connect(daemon: DaemonProc, deadline_s: float) -> DaemonStore:
    """An engine's store on the daemon, polling until its socket answers (it listens once the store is open)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            # a lookup deadline well above an engine's: the machines running the tests are shared and busy
            return DaemonStore(daemon.socket, ENGINE, GROUPS, 1 << 20, lookup_timeout_s=30.0)
        except DaemonUnavailable:
            assert daemon.proc.poll() is None, daemon.read_log()
            assert time.monotonic() < deadline, "the daemon never answered on its socket"
            time.sleep(0.05)  # polling interval of a real condition (the socket answering)


def daemon_info(daemon: DaemonProc) -> DaemonInfo:
    with Connection(daemon.socket, timeout_s=30.0, name="test") as conn:
        info = conn.stats().daemon
    assert info is not None
    return info


@pytest.mark.parametrize("profile", ["ref-tiny", "deepseek-v4-flash"])
def test_the_serve_guard_sums_a_block_as_the_pools_do(tmp_path: Path, profile: str) -> None:
    """`check_pool_slots` adds up a block without kvtier.gpu (torch): at a budget one byte short of a block and at
    exactly a block, of every form, it refuses exactly when the pools' own sum would."""
    prof = load_profile(profile)
    h = prof.hash_block_tokens
    forms = list(dict.fromkeys(g.form for g in prof.groups))
    block = {f: sum(slot_stride(g.object_bytes(h)) for g in prof.groups if g.form is f) for f in forms}
    for short in forms:
        for budget in (block[short] - 1, block[short]):
            budgets = {f: (budget if f is short else 4 * block[f]) for f in forms}
            config = tmp_path / "k.toml"
            lines = "".join(f"{f.value} = {n}\n" for f, n in budgets.items())
            config.write_text(f'device = "cpu"\nprofiles = ["{profile}"]\n[pool.budget_bytes]\n{lines}')
            try:
                _slots_per_form(prof, budgets)
                pools_refuse = False
            except BudgetError:
                pools_refuse = True
            if pools_refuse:
                with pytest.raises(ConfigError, match=short.value):
                    check_pool_slots(load_config(config, mode="user"))
            else:
                check_pool_slots(load_config(config, mode="user"))
            assert pools_refuse == (budget < block[short])
