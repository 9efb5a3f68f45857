"""Start-up guards (issue 41): an operator's mistake is one line and exit 2 before anything is allocated, and
`kvtier status` says "starting" (exit 5) while a daemon allocates its pools."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtier.cli.guards import MemoryRoom, cgroup_room, check_pool_budget, check_store_parent, pool_bytes
from kvtier.cli.starting import marker_path
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from support.configs import write_tiny_config
from support.daemon import child_env


def _serve(config: Path, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier.cli", "serve", "--config", str(config)],
        env=child_env(),
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _kvtier(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args],
        env=child_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], err


def test_a_pool_budget_over_ram_is_one_line_and_allocates_nothing(tmp_path: Path) -> None:
    """The issue's case (`compressed = "200GiB"` grew RSS by ~300 MB/s until killed): now exit 2, one line,
    and the process never grew past what its imports take."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    over = f"{ram // 2**30 + 8}GiB"
    config = write_tiny_config(tmp_path, compressed=over)
    proc = _serve(config, tmp_path)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 2, err
    _one_line(err, "key 'pool.budget_bytes'", "MemAvailable", "lower [pool.budget_bytes]")
    assert usage.ru_maxrss * 1024 < 1.5 * 2**30, f"peak RSS {usage.ru_maxrss} KiB: something was allocated"
    assert not (tmp_path / "store").exists()  # refused before the store was opened


def test_pool_budget_against_a_cgroup_limit(tmp_path: Path) -> None:
    """A planted cgroup tree (v2 and v1 layouts): the tightest limit less usage, up the ancestors, is the room."""
    v2 = tmp_path / "v2"
    (v2 / "a" / "b").mkdir(parents=True)
    (v2 / "a" / "memory.max").write_text(f"{4 * 2**30}\n")
    (v2 / "a" / "memory.current").write_text(f"{3 * 2**30}\n")
    (v2 / "a" / "b" / "memory.max").write_text("max\n")
    (v2 / "a" / "b" / "memory.current").write_text("0\n")
    own = tmp_path / "cgroup"
    own.write_text("0::/a/b\n")
    assert cgroup_room(v2, own) == (2**30, str(v2 / "a"))
    v1 = tmp_path / "v1"
    (v1 / "memory" / "x").mkdir(parents=True)
    (v1 / "memory" / "x" / "memory.limit_in_bytes").write_text(f"{2 * 2**30}\n")
    (v1 / "memory" / "x" / "memory.usage_in_bytes").write_text(f"{2**29}\n")
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("1\n")
    own.write_text("4:memory:/x\n1:cpu:/\n")
    assert cgroup_room(v1, own) == (3 * 2**29, str(v1 / "memory" / "x"))
    cfg_file = write_tiny_config(tmp_path, compressed="1GiB")
    cfg = load_config(cfg_file, env={}, cwd=tmp_path)
    assert pool_bytes(cfg) == 2**30 + (16 + 64 + 128) * 2**10
    room = MemoryRoom(mem_available=64 * 2**30, cgroup_room=2**30, cgroup_path="/sys/fs/cgroup/x")
    with pytest.raises(ConfigError, match=r"cgroup /sys/fs/cgroup/x has 1.0 GiB left"):
        check_pool_budget(cfg, "cpu", room)
    check_pool_budget(cfg, "cpu", MemoryRoom(64 * 2**30, 2 * 2**30, "/x"))  # fits: no error


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the missing-device case cannot arise")
def test_a_device_the_host_lacks(tmp_path: Path) -> None:
    config = write_tiny_config(tmp_path, {"device": "cuda"})
    proc = _kvtier("serve", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr, "key 'device'", "no usable CUDA device", 'set device = "cpu"')


@pytest.mark.parametrize("command", ["config show", "serve"])
def test_an_address_out_of_range_is_caught_in_config_show_as_in_serve(tmp_path: Path, command: str) -> None:
    config = write_tiny_config(tmp_path, {"metrics.address": "0.0.0.0:99999"}, check=False)
    proc = _kvtier(*command.split(), "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr, "key 'metrics.address'", "port 99999 is out of range")


def test_a_store_root_whose_parent_is_missing(tmp_path: Path) -> None:
    config = write_tiny_config(tmp_path, {"store.root": tmp_path / "typo" / "store"})
    proc = _kvtier("serve", "--config", str(config), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr, "key 'store.root'", f"{tmp_path}/typo does not exist", "store.create = true")
    assert not (tmp_path / "typo").exists()
    write_tiny_config(tmp_path, {"store.root": tmp_path / "typo" / "store", "store.create": True})
    check_store_parent(load_config(config, env={}, cwd=tmp_path))  # allowed now


def _status(cwd: Path, socket: Path) -> subprocess.CompletedProcess[str]:
    return _kvtier("status", "--socket", str(socket), cwd=cwd)


def test_status_says_starting_while_the_daemon_allocates(tmp_path: Path) -> None:
    """The daemon is stopped (SIGSTOP) inside its start, right after it claimed it: status says starting with
    exit 5; let go, it serves and status is 0; killed inside its start, the marker it leaves is not believed."""
    config = write_tiny_config(tmp_path)
    socket = tmp_path / "k.sock"
    marker = marker_path(socket)

    def wait(cond, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 120
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.001)  # polling a real condition (a file the daemon writes)

    daemon = _serve(config, tmp_path)
    try:
        wait(marker.exists, "no starting marker")
        daemon.send_signal(signal.SIGSTOP)
        if socket.exists():  # it got through its start before the stop: nothing to see this time
            pytest.fail("the daemon listened before it could be stopped in its start; rerun")
        proc = _status(tmp_path, socket)
        assert proc.returncode == 5, proc.stdout + proc.stderr
        _one_line(proc.stderr, "starting", f"pid {daemon.pid}")
        daemon.send_signal(signal.SIGCONT)
        wait(lambda: not marker.exists(), "the marker stayed after the daemon listened")
        # listening, it answers status itself: "starting" (exit 5) while its pools allocate, then healthy
        answered, deadline = _status(tmp_path, socket), time.monotonic() + 120
        while answered.returncode == 5:
            assert "health     starting" in answered.stdout, answered.stdout + answered.stderr
            assert time.monotonic() < deadline, "status said starting for 120 s after the daemon listened"
            answered = _status(tmp_path, socket)
        assert answered.returncode in (0, 1)  # served: healthy or degraded
    finally:
        daemon.send_signal(signal.SIGCONT)
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)

    daemon = _serve(config, tmp_path)
    wait(marker.exists, "no starting marker")
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    if marker.exists():  # killed inside its start: the marker is stale and must not be believed
        proc = _status(tmp_path, socket)
        assert proc.returncode == 3, proc.stdout + proc.stderr
