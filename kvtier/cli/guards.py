"""Start-up guards of `kvtier serve` (also read by `kvtier doctor`): each one a one-line ConfigError naming the
key, raised before anything is allocated, so a mistake costs nothing but the message.

- the pools' budgets against the memory this daemon may use: MemAvailable and the cgroup's limit less its use
  (a budget over RAM used to grow the daemon until the node swapped or the OOM killer came);
- a device this host lacks (cuda without CUDA, cuda:N past the GPUs there are);
- a store root whose parent folder does not exist (a mistyped root used to start an empty store), unless
  `store.create = true`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvtier.core.config import DaemonConfig
from kvtier.core.errors import ConfigError
from kvtier.core.layout import slot_stride
from kvtier.core.profile import load_profile
from kvtier.core.units import format_bytes

_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryRoom:
    """What this process may still take: MemAvailable and the tightest cgroup's limit less its usage."""

    mem_available: int | None
    cgroup_room: int | None
    cgroup_path: str | None

    @property
    def usable(self) -> int | None:
        known = [v for v in (self.mem_available, self.cgroup_room) if v is not None]
        return min(known) if known else None

    def describe(self) -> str:
        parts = [f"MemAvailable {format_bytes(self.mem_available)}" if self.mem_available is not None else ""]
        if self.cgroup_room is not None:
            parts.append(f"cgroup {self.cgroup_path} has {format_bytes(self.cgroup_room)} left below its limit")
        return "; ".join(p for p in parts if p) or "no MemAvailable and no cgroup limit readable"


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else int(text)


def cgroup_room(
    cgroup_root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")
) -> tuple[int, str] | tuple[None, None]:
    """(bytes left, cgroup) of the tightest memory limit on this process's cgroup and its ancestors (v2's
    memory.max - memory.current, or v1's limit_in_bytes - usage_in_bytes); (None, None) when none is set."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    best: tuple[int, str] | None = None
    for line in lines:
        hier, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hier == "0" and controllers == "":
            base, limit_f, usage_f = cgroup_root, "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_f, usage_f = cgroup_root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        folder = base / path.lstrip("/")
        if not folder.is_dir():  # a cgroup namespace: our own cgroup is the mount's root
            folder = base
        while True:
            limit, usage = _read_int(folder / limit_f), _read_int(folder / usage_f)
            if limit is not None and limit < _UNLIMITED and usage is not None:
                room = max(0, limit - usage)
                if best is None or room < best[0]:
                    best = (room, str(folder))
            if folder == base or folder.parent == folder:
                break
            folder = folder.parent
    return (best[0], best[1]) if best else (None, None)


def memory_room() -> MemoryRoom:
    room, path = cgroup_room()
    return MemoryRoom(mem_available(), room, path)


def pool_bytes(cfg: DaemonConfig) -> int:
    """What the pools will take: each profile's budget of every form it has (each profile has its own pools)."""
    total = 0
    for name in cfg.profiles:
        forms = {g.form.value for g in load_profile(name).groups}
        total += sum(cfg.pool.budget_bytes[f] for f in forms)
    return total


def check_pool_budget(cfg: DaemonConfig, device: str, room: MemoryRoom | None = None) -> None:
    """Pools in host memory (device cpu) must fit what this daemon may use; on cuda, the GPU's free memory."""
    need = pool_bytes(cfg)
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if need > free:
            raise ConfigError(
                f"the pools need {format_bytes(need)} but {device} has {format_bytes(free)} free; "
                "lower [pool.budget_bytes]",
                key="pool.budget_bytes",
                source=cfg.source,
            )
        return
    room = room or memory_room()
    usable = room.usable
    if usable is not None and need > usable:
        raise ConfigError(
            f"the pools need {format_bytes(need)} ({len(cfg.profiles)} profile(s)) but this daemon may use "
            f"{format_bytes(usable)} ({room.describe()}); lower [pool.budget_bytes]",
            key="pool.budget_bytes",
            source=cfg.source,
        )


def check_pool_slots(cfg: DaemonConfig) -> None:
    """Every form's budget must hold a block of each profile's groups: checked before serving, since the pools
    themselves are allocated after the daemon listens (a failure there would stop a daemon already serving).

    The same sum as the pools' (`kvtier.gpu.slots._slots_per_form`), on the profile alone: importing kvtier.gpu
    loads torch, which the daemon leaves until it listens (tests/daemon/test_startup_torch.py holds them equal)."""
    for name in cfg.profiles:
        profile = load_profile(name)
        h = profile.hash_block_tokens
        for form in dict.fromkeys(g.form for g in profile.groups):
            per_block = sum(slot_stride(g.object_bytes(h)) for g in profile.groups if g.form is form)
            budget = cfg.pool.budget_bytes.get(form.value, 0)
            if budget < per_block:
                raise ConfigError(
                    f"profile {name}: the {form.value} budget ({budget} B) holds no block of its groups "
                    f"({per_block} B per block); raise it",
                    key="pool.budget_bytes",
                    source=cfg.source,
                )


def check_device(cfg: DaemonConfig) -> str:
    """The device the pools go on (`auto` resolved), or a ConfigError when this host lacks it."""
    if cfg.device == "cpu":
        return "cpu"  # without torch: a cpu daemon listens before torch is loaded (kvtier.daemon.pool_start)
    import torch

    has_cuda = torch.cuda.is_available()
    if cfg.device == "auto":
        return "cuda" if has_cuda else "cpu"
    if not has_cuda:
        raise ConfigError(
            f"{cfg.device!r} but this host has no usable CUDA device (torch {torch.__version__}, "
            f'built for CUDA {torch.version.cuda or "none"}); set device = "cpu" or "auto"',
            key="device",
            source=cfg.source,
        )
    index = int(cfg.device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"{cfg.device!r} but this host has {torch.cuda.device_count()} CUDA device(s); "
            f'pick cuda:0..cuda:{torch.cuda.device_count() - 1} or "auto"',
            key="device",
            source=cfg.source,
        )
    return cfg.device


def check_store_parent(cfg: DaemonConfig) -> None:
    """A store root that does not exist yet is made only inside a folder that does (or with create = true)."""
    root = cfg.store.root
    if cfg.store.create or root.exists() or root.parent.exists():
        return  # a parent that is a file, or not ours to write, is _check_paths' to name
    raise ConfigError(
        f"{root}: its folder {root.parent} does not exist (mistyped?); fix the path, create the folder, "
        "or set store.create = true",
        key="store.root",
        source=cfg.source,
    )


def startup_guards(cfg: DaemonConfig) -> str:
    """Every guard `kvtier serve` runs before allocating; the resolved device."""
    check_store_parent(cfg)
    device = check_device(cfg)
    check_pool_budget(cfg, device)
    return device
