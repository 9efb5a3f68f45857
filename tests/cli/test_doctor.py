"""`kvtier doctor` (issue 41): on this machine every line says what is true, and each kind of problem, planted,
turns its line to warn or fail with a fix."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtier.cli import doctor as D
from kvtier.core import hugepages
from kvtier.core.config import load_config
from kvtier.core.profile import load_profile
from support.configs import write_tiny_config
from support.daemon import DaemonProc, child_env


def _doctor(cwd: Path, *args: str) -> tuple[int, dict[str, list[dict[str, str]]]]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "doctor", "--json", *args],
        env=child_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.stdout, proc.stderr
    by_name: dict[str, list[dict[str, str]]] = {}
    for c in json.loads(proc.stdout):
        by_name.setdefault(c["name"], []).append(c)
    return proc.returncode, by_name


def _checks(*args: str) -> tuple[int, dict[str, list[dict[str, str]]]]:
    """The same checks in this process (the CLI's own run is the first test's): exit code and lines by name."""
    checks = D.run_checks(args[1] if args and args[0] == "--config" else None, None)
    by_name: dict[str, list[dict[str, str]]] = {}
    for c in checks:
        by_name.setdefault(c.name, []).append(c.to_dict())
    return (1 if any(c.status == D.FAIL for c in checks) else 0), by_name


def _config(tmp_path: Path, keys: dict[str, Any] | None = None, **kw: Any) -> Path:
    return write_tiny_config(tmp_path, keys, **kw)


def test_on_this_machine_every_line_is_true(tmp_path: Path) -> None:
    code, c = _doctor(tmp_path, "--config", str(_config(tmp_path)))
    assert code == 0, c
    assert c["config"][0]["status"] == "ok" and "user mode" in c["config"][0]["detail"]
    assert c["memory"][0]["status"] == "ok" and "pools need 272.0 KiB" in c["memory"][0]["detail"]
    plan = hugepages.shared_pages(hugepages.read_host(), D._pool_sizes(load_config(str(_config(tmp_path)))))
    words = {
        "thp": "transparent huge pages",
        "hugetlb": "hugetlb pages",
        "collapse": "transparent huge pages moved in once made",
        "small": "small pages",
    }[plan.how.value]
    assert c["huge pages"][0]["detail"].startswith(f"pools (272.0 KiB) get {words} (shmem_enabled = ")
    assert c["huge pages"][0]["status"] == ("warn" if plan.how is hugepages.SharedPages.SMALL else "ok")
    assert f"fs.aio-max-nr {int(D.AIO_MAX_NR.read_text()):,}" in c["aio-max-nr"][0]["detail"]
    assert c["O_DIRECT"][0]["status"] == "ok"  # pytest's tmp folder is on a disk filesystem here
    assert c["socket"][0]["status"] == "warn" and "no daemon" in c["socket"][0]["detail"]
    assert c["cluster"][0]["status"] == "ok" and "off" in c["cluster"][0]["detail"]
    assert {"vllm", "sglang", "gpu", "gds"} <= set(c)
    assert c["gpu"][0]["status"] == "ok" and ("CUDA device" in c["gpu"][0]["detail"])
    assert not list(tmp_path.glob("store/.kvtier-doctor-*")) and not list(tmp_path.glob(".kvtier-doctor-*"))


def test_a_live_daemon_makes_the_socket_line_ok(tmp_path: Path) -> None:
    # returns once the daemon serves; an engine-only one (no profiles, so no pools and no torch on its pool
    # thread): the socket line asks only whether a daemon answers on the socket
    daemon = DaemonProc(tmp_path, profiles=())
    try:
        _, c = _doctor(tmp_path, "--config", str(daemon.config))
    finally:
        daemon.close()
    assert c["socket"][0]["status"] == "ok" and "a daemon answers" in c["socket"][0]["detail"], c["socket"]


def test_planted_config_memory_disk_and_cluster_problems(tmp_path: Path) -> None:
    code, c = _checks("--config", str(_config(tmp_path, {"bogus": 1}, check=False)))
    assert code == 1 and c["config"][0]["status"] == "fail" and "key 'bogus'" in c["config"][0]["detail"]
    assert set(c) == {"config"}  # nothing else can be judged without a config

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    code, c = _checks("--config", str(_config(tmp_path, compressed=f"{ram // 2**30 + 8}GiB")))
    assert code == 1 and c["memory"][0]["status"] == "fail" and "lower [pool.budget_bytes]" in c["memory"][0]["fix"]

    code, c = _checks("--config", str(_config(tmp_path, {"store.budget_bytes": "1000TiB"})))
    assert c["free space"][0]["status"] == "warn" and "store.budget_bytes" in c["free space"][0]["fix"]

    # a store root under a file (a mistyped path): nothing can be opened there, O_DIRECT or not
    (tmp_path / "a-file").write_text("")
    code, c = _checks("--config", str(_config(tmp_path, {"store.root": tmp_path / "a-file" / "store"})))
    assert c["O_DIRECT"][0]["status"] == "fail" and "is not a folder" in c["O_DIRECT"][0]["detail"], c["O_DIRECT"]

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]  # bound, never listening: a connect is refused
    try:
        cluster = {
            "cluster.enabled": True,
            "cluster.master": f"127.0.0.1:{port}",
            "cluster.metadata": f"http://127.0.0.1:{port}/m",
        }
        code, c = _checks("--config", str(_config(tmp_path, cluster)))
    finally:
        closed.close()
    assert code == 1 and [x["status"] for x in c["cluster"]] == ["fail", "fail"], c["cluster"]
    assert f"master 127.0.0.1:{port} unreachable" in c["cluster"][0]["detail"]
    assert c["cluster unit"][0]["status"] == "ok"  # no kvtier.service installed on this machine


def test_planted_unit_that_blocks_the_cluster(tmp_path: Path) -> None:
    """The project's kvtier.service (localhost only) blocks a remote master; its cluster drop-in lets it through."""
    cfg = load_config(str(_config(tmp_path, {"cluster.enabled": True, "cluster.master": "10.1.2.3:50051"})))
    units = tmp_path / "root" / "etc" / "systemd" / "system"
    units.mkdir(parents=True)
    repo = Path(__file__).resolve().parents[2]
    shutil.copy(repo / "systemd" / "kvtier.service", units)
    blocked = D.check_unit_blocks_cluster(cfg, tmp_path / "root")
    assert blocked.status == "fail" and "10.1.2.3:50051" in blocked.detail and "drop-in" in blocked.fix
    (units / "kvtier.service.d").mkdir()
    shutil.copy(repo / "systemd" / "drop-ins" / "kvtier-cluster.conf", units / "kvtier.service.d")
    assert D.check_unit_blocks_cluster(cfg, tmp_path / "root").status == "ok"


def test_planted_kernel_knobs(tmp_path: Path) -> None:
    cfg = load_config(str(_config(tmp_path)))
    sizes = D._pool_sizes(cfg)
    assert len(sizes) == len(load_profile(cfg.profiles[0]).groups)  # one memfd per cache group
    pages = sum(-(-n // hugepages.HUGE_PAGE) for n in sizes)
    stock = D.check_huge_pages(cfg, hugepages.HostPages("never", 0, hugepages.HUGE_PAGE))
    assert stock.status == "warn" and stock.detail.startswith("pools (272.0 KiB) get small pages")
    assert "echo advise" in stock.fix and f"vm.nr_hugepages by {pages}" in stock.fix
    thp = D.check_huge_pages(cfg, hugepages.HostPages("advise", 0, hugepages.HUGE_PAGE))
    assert thp.status == "ok" and "transparent huge pages (shmem_enabled = advise)" in thp.detail
    reserved = D.check_huge_pages(cfg, hugepages.HostPages("never", pages, hugepages.HUGE_PAGE))
    assert reserved.status == "ok" and "hugetlb pages" in reserved.detail and not reserved.fix
    short = D.check_huge_pages(cfg, hugepages.HostPages("never", pages - 1, hugepages.HUGE_PAGE))
    assert short.status == "warn" and "vm.nr_hugepages by 1 " in short.fix
    on_gpu = D.check_huge_pages(dataclasses.replace(cfg, device="cuda:0"), hugepages.HostPages("never", 0, 0))
    assert on_gpu.status == "ok" and "cuda:0 memory" in on_gpu.detail
    most, nr = tmp_path / "aio-max-nr", tmp_path / "aio-nr"
    most.write_text("65536\n")
    nr.write_text("65000\n")
    bad = D.check_aio(4, most, nr)
    assert bad.status == "warn" and "fs.aio-max-nr=1048576" in bad.fix
    nr.write_text("0\n")
    assert D.check_aio(4, most, nr).status == "ok"


def test_planted_engine_venvs(tmp_path: Path) -> None:
    """An engine that does not import, and one of a version kvtier does not implement, in a python of their own."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm-0.1.0.dist-info").mkdir()
    (site / "vllm-0.1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.1.0\n")
    (site / "sglang").mkdir()
    (site / "sglang" / "__init__.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    python = tmp_path / "engine-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    vllm, sglang = D.check_engine("vllm", str(python)), D.check_engine("sglang", str(python))
    assert vllm.status == "warn" and "vllm 0.1.0" in vllm.detail and "0.32." in vllm.fix
    assert sglang.status == "fail" and "libcuda.so.1" in sglang.detail
    absent = D.check_engine("vllm", sys.executable)
    assert absent.status in ("ok", "warn")  # not installed (ok) here, or installed in this venv


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: the missing-GPU case cannot arise")
def test_planted_gpu_device(tmp_path: Path) -> None:
    cfg = load_config(_config(tmp_path, {"device": "cuda"}), env={}, cwd=tmp_path)
    gpu, gds = D.check_gpu(cfg)
    assert gpu.status == "fail" and 'device = "cpu"' in gpu.fix and gds.status == "ok"
