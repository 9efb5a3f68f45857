"""A supervised verifier never outlives its daemon, however the daemon dies (issue 18): the daemon is killed
with SIGKILL at random moments right after it starts, and afterwards no verifier process of it is left."""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.daemon import child_env

# the acceptance's number: ~80 CPU-seconds in all (142 s wall on 2 cores shared with a load of 7; about half
# that on 2 idle cores); KVTIER_ORPHAN_KILLS lowers it where CI time is short
KILLS = int(os.environ.get("KVTIER_ORPHAN_KILLS", "50"))
AT_ONCE = 4  # daemons started (and killed) concurrently: a start is mostly interpreter imports, I/O-bound enough
# the cheapest start that still supervises a verifier: tiny pools, no metrics endpoint (~1.6 s to its spawn)
CONFIG = """device = "cpu"
profiles = ["ref-tiny"]
[server]
socket = "{root}/k.sock"
[store]
root = "{root}/store"
[verifier]
mode = "supervise"
[metrics]
address = ""
[pool.budget_bytes]
compressed = "64KiB"
indexer = "16KiB"
tail = "64KiB"
swa = "128KiB"
"""


def _verifiers_of(store: Path) -> list[int]:
    """Pids of `kvtier verifier run` processes on this store (whoever their parent is now)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"verifier" in argv and str(store).encode() in argv:
            found.append(int(entry.name))
    return found


def _kill_once(root: Path, rng: random.Random) -> bool:
    """Start a daemon, SIGKILL it at a random moment of its start, wait for its verifier to go (fail if it
    does not); whether the daemon had spawned a verifier by then."""
    root.mkdir()
    store = root / "store"
    config = root / "kvtier.toml"
    config.write_text(CONFIG.format(root=root))
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config)],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=root,
    )
    # the fault: a kill at a random moment of the start; mostly within 1 s of the verifier's spawn (its
    # interpreter starting, the fork -> prctl window), sometimes before the daemon got that far
    early = rng.random() < 0.2
    deadline = time.monotonic() + (rng.uniform(0.2, 3.0) if early else 60.0)
    while time.monotonic() < deadline and daemon.poll() is None and not _verifiers_of(store):
        time.sleep(0.005)  # polling a real condition (the verifier's spawn)
    if not early:
        time.sleep(rng.uniform(0.0, 1.0))
    seen = bool(_verifiers_of(store))
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    gone_by = time.monotonic() + 30
    while left := _verifiers_of(store):
        if time.monotonic() > gone_by:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"verifier processes {left} outlived their SIGKILLed daemon")
        time.sleep(0.05)  # polling a real condition (the orphan's exit)
    return seen


@pytest.mark.slow
def test_no_verifier_outlives_a_killed_daemon(tmp_path: Path) -> None:
    rngs = [random.Random(18_000 + i) for i in range(KILLS)]
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        seen = sum(pool.map(_kill_once, [tmp_path / f"k{i}" for i in range(KILLS)], rngs))
    assert seen >= KILLS // 2, f"the daemon had started a verifier in only {seen} of {KILLS} runs"
