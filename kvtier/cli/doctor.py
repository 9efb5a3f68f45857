"""`kvtier doctor`: what this host and config mean for a daemon, one line per check: ok / warn / fail, and the fix.

Every check reads the thing itself (the config file, /proc, /sys, the store's filesystem, the socket, a TCP
connect, an import in the engine's Python), never a belief recorded elsewhere. A check that cannot run says so.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import urlparse

from kvtier.cli.guards import memory_room, pool_bytes
from kvtier.cli.starting import starting
from kvtier.core import hugepages
from kvtier.core.config import DaemonConfig, load_config
from kvtier.core.errors import KvtierError
from kvtier.core.layout import DISK_ALIGNMENT, slot_stride
from kvtier.core.profile import load_profile
from kvtier.core.units import format_bytes

OK, WARN, FAIL = "ok", "warn", "fail"
SUPPORTED_ENGINES = {"vllm": "0.32.", "sglang": "0.5.23"}  # what kvtier.integrations implements (prefixes)
AIO_MAX_NR, AIO_NR = Path("/proc/sys/fs/aio-max-nr"), Path("/proc/sys/fs/aio-nr")


@dataclasses.dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # OK / WARN / FAIL
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


# ---- config and memory -----------------------------------------------------------------------------------------


def check_config(config_path: str | None, mode: str | None) -> tuple[Check, DaemonConfig | None]:
    try:
        cfg = load_config(config_path, mode=mode)
    except KvtierError as exc:
        return Check("config", FAIL, str(exc), "fix the key it names (`kvtier config init` writes every key)"), None
    served = f"profiles {', '.join(cfg.profiles)}" if cfg.profiles else "no profiles (an engine-only node, no pools)"
    return Check("config", OK, f"{cfg.mode} mode ({cfg.mode_why}); file {cfg.file}; {served}"), cfg


def check_memory(cfg: DaemonConfig) -> Check:
    if not cfg.profiles:
        return Check(
            "memory",
            OK,
            "no pools: profiles = [] (an engine-only node; engines' tier ops only, [pool.budget_bytes] unused)",
        )
    try:
        need = pool_bytes(cfg)
    except KvtierError as exc:
        return Check("memory", FAIL, str(exc), "fix `profiles`")
    if cfg.device != "cpu":
        return Check("memory", OK, f"pools {format_bytes(need)} on {cfg.device} (`kvtier serve` checks the GPU)")
    room = memory_room()
    usable = room.usable
    if usable is None:
        return Check("memory", WARN, f"pools need {format_bytes(need)}; {room.describe()}", "")
    detail = f"pools need {format_bytes(need)}; may use {format_bytes(usable)} ({room.describe()})"
    if need > usable:
        return Check("memory", FAIL, detail, "lower [pool.budget_bytes] (serve refuses to start)")
    if need > 0.8 * usable:
        return Check("memory", WARN, detail, "leave room for the engines: lower [pool.budget_bytes]")
    return Check("memory", OK, detail)


# ---- kernel knobs ----------------------------------------------------------------------------------------------


def check_huge_pages(cfg: DaemonConfig, host: hugepages.HostPages | None = None) -> Check:
    """How the cpu pools (shared memory: a memfd each) get large pages on this host, read from the kernel now
    (`kvtier.core.hugepages.shared_pages`, the choice the daemon makes for each pool at start)."""
    if cfg.device.startswith("cuda"):
        return Check("huge pages", OK, f"not used by the pools: they are {cfg.device} memory")
    if not cfg.profiles:
        return Check("huge pages", OK, "no pools: profiles = [] (an engine-only node)")
    try:
        need, sizes = pool_bytes(cfg), _pool_sizes(cfg)
    except KvtierError as exc:
        return Check("huge pages", FAIL, str(exc), "fix `profiles`")
    plan = hugepages.shared_pages(host or hugepages.read_host(), sizes)
    detail = f"pools ({format_bytes(need)}) get {plan.why}"
    if plan.how is hugepages.SharedPages.SMALL:
        return Check("huge pages", WARN, f"{detail}: restores read in smaller requests", plan.fix)
    return Check("huge pages", OK, detail)


def _pool_sizes(cfg: DaemonConfig) -> list[int]:
    """The bytes of each pool the daemon will map (one per cache group of each profile): as many whole blocks as
    the form's budget holds, each group's slots in its own memfd, plus the alignment margin."""
    sizes = []
    for name in cfg.profiles:
        profile = load_profile(name)
        h = profile.hash_block_tokens
        for form in {g.form for g in profile.groups}:
            groups = [g for g in profile.groups if g.form is form]
            blocks = cfg.pool.budget_bytes[form.value] // sum(slot_stride(g.object_bytes(h)) for g in groups)
            sizes += [blocks * slot_stride(g.object_bytes(h)) + DISK_ALIGNMENT for g in groups]
    return sizes


def check_aio(io_threads: int, max_path: Path = AIO_MAX_NR, nr_path: Path = AIO_NR) -> Check:
    """The store reads with native AIO, `DEPTH` events per context; asked for room for two contexts per I/O thread
    (a margin, not a count of the store's contexts). Where io_setup is refused, the store reads with threads."""
    from kvtier.store.aio import DEPTH

    try:
        most, used = int(max_path.read_text()), int(nr_path.read_text())
    except (OSError, ValueError):
        return Check("aio-max-nr", WARN, f"cannot read {max_path}", "")
    need = DEPTH * 2 * io_threads
    detail = f"fs.aio-max-nr {most:,}, in use {used:,}; the store's readers may take {need:,}"
    if most - used < need:
        return Check("aio-max-nr", WARN, detail, "sudo sysctl -w fs.aio-max-nr=1048576 (and in /etc/sysctl.d)")
    return Check("aio-max-nr", OK, detail)


def _existing(path: Path) -> Path:
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_o_direct(root: Path) -> Check:
    """Open a file in the store's folder (or the nearest folder that exists) with O_DIRECT and write one block."""
    where = _existing(root)
    if not where.is_dir():
        return Check("O_DIRECT", FAIL, f"{where} is not a folder", "fix store.root")
    try:
        fd, name = tempfile.mkstemp(prefix=".kvtier-doctor-", dir=where)
    except OSError as exc:
        return Check(
            "O_DIRECT", FAIL, f"cannot create a file in {where}: {exc.strerror}", "fix store.root's permissions"
        )
    os.close(fd)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
            os.write(fd, buf)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return Check(
                "O_DIRECT",
                WARN,
                f"the filesystem of {where} refuses O_DIRECT (tmpfs?): reads go through the page cache",
                "put store.root on a local disk filesystem (ext4, xfs)",
            )
        return Check("O_DIRECT", FAIL, f"O_DIRECT write in {where}: {exc.strerror}", "check the store's disk")
    finally:
        os.unlink(name)
    return Check("O_DIRECT", OK, f"{where}: O_DIRECT works")


def check_free_space(cfg: DaemonConfig) -> Check:
    where = _existing(cfg.store.root)
    free = shutil.disk_usage(where).free
    used = _tree_bytes(cfg.store.root)
    room = cfg.store.budget_bytes - used
    detail = f"{format_bytes(free)} free on {where}; store budget {format_bytes(cfg.store.budget_bytes)}"
    if room > free:
        return Check(
            "free space", WARN, f"{detail}, {format_bytes(used)} used", "lower store.budget_bytes or free the disk"
        )
    return Check("free space", OK, detail)


def _tree_bytes(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(folder, f)).st_size
            except OSError:
                continue
    return total


# ---- the socket ------------------------------------------------------------------------------------------------


def check_socket(cfg: DaemonConfig) -> Check:
    path = cfg.server.socket
    lists = f"allowed_uids {list(cfg.server.allowed_uids)}, allowed_gids {list(cfg.server.allowed_gids)}"
    if (st := starting(path)) is not None:
        return Check("socket", WARN, f"{path}: kvtier serve (pid {st.pid}) is starting", "wait, then `kvtier status`")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except OSError as exc:
        why = "nothing there" if exc.errno == errno.ENOENT else exc.strerror
        return Check("socket", WARN, f"{path}: no daemon ({why}); {lists}", "start it: `kvtier serve` (or systemctl)")
    finally:
        probe.close()
    owner = path.stat().st_uid
    me = os.geteuid()
    admitted = (
        me in (0, owner) or me in cfg.server.allowed_uids or bool(set(os.getgroups()) & set(cfg.server.allowed_gids))
    )
    detail = f"{path}: a daemon answers (uid {owner}); {lists}"
    if not admitted:
        return Check("socket", WARN, f"{detail}; uid {me} is not admitted", f"add {me} to server.allowed_uids")
    return Check("socket", OK, detail)


# ---- the cluster -----------------------------------------------------------------------------------------------


def _endpoints(cfg: DaemonConfig) -> list[tuple[str, str, int]]:
    c = cfg.cluster
    out: list[tuple[str, str, int]] = []
    masters = [("etcd", e) for e in c.etcd.split(";") if e] or [("master", c.master)]
    for what, hostport in masters:
        host, _, port = hostport.rpartition(":")
        out.append((what, host.strip("[]"), int(port)))
    if c.metadata.startswith("http"):
        url = urlparse(c.metadata)
        out.append(("metadata", url.hostname or "", url.port or 80))
    return out


def check_cluster(cfg: DaemonConfig, timeout_s: float = 2.0) -> list[Check]:
    if not cfg.cluster.enabled:
        return [Check("cluster", OK, "off ([cluster] enabled = false): a single node")]
    out = []
    for what, host, port in _endpoints(cfg):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except OSError as exc:
            out.append(
                Check(
                    "cluster",
                    FAIL,
                    f"{what} {host}:{port} unreachable: {exc.strerror or exc}",
                    f"start the {what} or fix cluster.{'etcd' if what == 'etcd' else what}",
                )
            )
        else:
            out.append(Check("cluster", OK, f"{what} {host}:{port} reachable"))
    out.append(check_unit_blocks_cluster(cfg))
    return out


def check_unit_blocks_cluster(cfg: DaemonConfig, root: Path = Path("/")) -> Check:
    """Whether the installed kvtier.service (with its drop-ins, under `root`) lets the daemon reach the `[cluster]`
    endpoints."""
    from kvtier.cluster.unit_check import installed_unit, unit_blocks  # the cluster package only for a cluster node

    unit = installed_unit(root)
    if not unit:
        return Check("cluster unit", OK, "no kvtier.service installed: nothing restricts the daemon's addresses")
    blocked = unit_blocks(cfg.cluster, unit)
    if not blocked:
        return Check("cluster unit", OK, "kvtier.service allows every [cluster] endpoint")
    return Check(
        "cluster unit",
        FAIL,
        "kvtier.service would block " + "; ".join(b.line() for b in blocked),
        "install systemd/drop-ins/kvtier-cluster.conf with your cluster's network (docs/cluster.md)",
    )


# ---- engines and GPU -------------------------------------------------------------------------------------------


def check_engine(engine: str, python: str) -> Check:
    """Import the engine in that Python and compare its version with the one kvtier's integration implements."""
    code = f"import importlib.metadata as m, {engine}; print(m.version({engine!r}))"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(engine, FAIL, f"cannot run {python}: {exc}", "pass the engine venv's python")
    want = SUPPORTED_ENGINES[engine]
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        if "ModuleNotFoundError" in last and f"'{engine}'" in last:
            return Check(engine, OK, f"not installed in {python} (only needed where that engine runs)")
        return Check(engine, FAIL, f"import {engine} fails in {python}: {last}", "repair that venv")
    version = proc.stdout.strip()
    if not version.startswith(want):
        return Check(
            engine, WARN, f"{engine} {version} in {python}; kvtier supports {want}*", f"pip install {engine}=={want}*"
        )
    return Check(engine, OK, f"{engine} {version} in {python}")


def check_gpu(cfg: DaemonConfig) -> list[Check]:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        status, fix = (FAIL, 'set device = "cpu" or "auto"') if cfg.device.startswith("cuda") else (OK, "")
        gpu = Check("gpu", status, f"no CUDA device (torch {torch.__version__}); device = {cfg.device!r}", fix)
        return [gpu, Check("gds", OK, "not used: the store takes the POSIX O_DIRECT path")]
    gpu = Check("gpu", OK, f"{torch.cuda.device_count()} CUDA device(s), torch {torch.__version__}")
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return [
            gpu,
            Check("gds", WARN, "kvikio is not installed: the POSIX O_DIRECT path", "pip install 'kvtier[gpu]'"),
        ]
    return [gpu, Check("gds", OK, "kvikio importable: GPUDirect Storage where cuFile allows it")]


# ---- all of it -------------------------------------------------------------------------------------------------


def run_checks(config_path: str | None, mode: str | None, engine_pythons: Iterable[str] = ()) -> list[Check]:
    first, cfg = check_config(config_path, mode)
    checks = [first]
    if cfg is None:
        return checks
    steps: list[Callable[[], Check | list[Check]]] = [
        lambda: check_memory(cfg),
        lambda: check_huge_pages(cfg),
        lambda: check_aio(cfg.store.io_threads),
        lambda: check_o_direct(cfg.store.root),
        lambda: check_free_space(cfg),
        lambda: check_socket(cfg),
        lambda: check_cluster(cfg),
        lambda: [check_engine(e, py) for py in (list(engine_pythons) or [sys.executable]) for e in SUPPORTED_ENGINES],
        lambda: check_gpu(cfg),
    ]
    for step in steps:
        got = step()
        checks.extend(got if isinstance(got, list) else [got])
    return checks
