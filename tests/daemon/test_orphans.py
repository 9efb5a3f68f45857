"""A supervised verifier never outlives its daemon, however the daemon dies (issue 18): the daemon is killed
with SIGKILL at random moments right after it starts, and afterwards no verifier process of it is left."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.daemon import child_env

KILLS = int(
    os.environ.get("KVTIER_ORPHAN_KILLS", "12")
)  # 50 for the acceptance run; one daemon start each (~5-8 s on 2 busy cores)


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


@pytest.mark.slow
def test_no_verifier_outlives_a_killed_daemon(tmp_path: Path) -> None:
    store = tmp_path / "store"
    config = tmp_path / "kvtier.toml"
    config.write_text(
        f'device = "cpu"\nprofiles = ["ref-tiny"]\n[server]\nsocket = "{tmp_path / "k.sock"}"\n'
        f'[store]\nroot = "{store}"\n[verifier]\nmode = "supervise"\n'
    )
    rng = random.Random(18)
    seen = 0
    for _ in range(KILLS):
        daemon = subprocess.Popen(
            [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config)],
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp_path,
        )
        # the fault: a kill at a random moment of the start; mostly within 2 s of the verifier's spawn (its
        # interpreter starting, the fork -> prctl window), sometimes before the daemon got that far
        early = rng.random() < 0.2
        deadline = time.monotonic() + (rng.uniform(0.2, 3.0) if early else 60.0)
        while time.monotonic() < deadline and daemon.poll() is None and not _verifiers_of(store):
            time.sleep(0.005)  # polling a real condition (the verifier's spawn)
        if not early:
            time.sleep(rng.uniform(0.0, 2.0))
        seen += bool(_verifiers_of(store))
        daemon.send_signal(signal.SIGKILL)
        daemon.wait()
        gone_by = time.monotonic() + 30
        while left := _verifiers_of(store):
            if time.monotonic() > gone_by:
                for pid in left:
                    os.kill(pid, signal.SIGKILL)
                pytest.fail(f"verifier processes {left} outlived their SIGKILLed daemon")
            time.sleep(0.05)  # polling a real condition (the orphan's exit)
    assert seen >= KILLS // 2, f"the daemon had started a verifier in only {seen} of {KILLS} runs"
