"""The daemon's TOML config: typed dataclasses, the two modes' defaults, one-line errors naming the key.

Two modes, always chosen explicitly, never by the uid that runs us: `user` (everything under ./.kvtier/, cpu,
ref-tiny, small pools, a supervised verifier) and `system` (the systemd unit's /run/kvtier and /var/lib/kvtier,
the bundled DSV4 profile, large pools, an external verifier, metrics on 127.0.0.1:9641). The mode comes from,
in order: `--user` / `--system`, the file's top-level `mode` key, `$KVTIER_MODE`, the directories systemd
sets for the unit (RUNTIME_DIRECTORY / STATE_DIRECTORY); else `user`. A partial file fills from that mode.

In `core` because two processes read the one file: the daemon (everything) and the verifier (rates, store
limits, profiles).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.core.cluster_config import ClusterConfig, WriteThrough
from kvtier.core.errors import ConfigError
from kvtier.core.events_config import EventsConfig, parse_events
from kvtier.core.forms import CacheForm

SYSTEM_CONFIG = Path("/etc/kvtier/kvtier.toml")
SYSTEMD_RUNTIME_DIR = Path("/run/kvtier")
SYSTEMD_STATE_DIR = Path("/var/lib/kvtier")
SOCKET_NAME = "kvtier.sock"
FORMS = tuple(f.value for f in CacheForm)
DEVICES = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
VERIFIER_MODES = ("supervise", "external", "off")
MODES = ("user", "system")
MODE_ENV = "KVTIER_MODE"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """The unix socket: where, who may connect, and the limits every connection lives under."""

    socket: Path
    socket_mode: int = 0o660
    allowed_uids: tuple[int, ...] = ()
    allowed_gids: tuple[int, ...] = ()
    max_frame_bytes: int = 16 * 2**20
    max_connections: int = 256
    frame_timeout_s: float = 10.0  # a begun frame must arrive whole (and its reply be taken) within this
    hello_timeout_s: float = 5.0  # a new connection must send its first frame within this
    idle_timeout_s: float = 900.0  # a connection silent between frames for this long is closed (0: never)
    max_buffered_bytes: int = 256 * 2**20  # frame bytes being received at once, all connections together


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    """Bytes of pool memory per form, per attached profile; allocated once at start."""

    budget_bytes: Mapping[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class StoreSection:
    """The disk store: its root, byte budget, per-form quotas and I/O width."""

    root: Path
    budget_bytes: int
    quota_bytes: Mapping[str, int]
    io_threads: int = 4
    codec: str = "none"
    create: bool = False  # make the root's parent folders too; off, a mistyped root fails instead of starting empty


@dataclasses.dataclass(frozen=True, slots=True)
class VerifierConfig:
    """The verifier process: supervised by the daemon, run by its own unit (external), or off; and its rates."""

    mode: str = "off"
    rate_bytes_per_s: int = 64 * 2**20
    busy_rate_bytes_per_s: int = 4 * 2**20  # while others use the disk (the verifier's settings say why 4 MiB/s)
    sweep_interval_s: float = 300.0
    restart_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    hung_after_s: float = 120.0  # a supervised verifier whose heartbeat is older than this is killed and restarted


@dataclasses.dataclass(frozen=True, slots=True)
class AdmissionSection:
    """The pools' admission caps (`kvtier.gpu.AdmissionConfig`): a global cap on occupied slots across every
    pool of a profile (0: their capacity), split into per-form reservations rebalanced toward demand every
    `rebalance_every` allocations, never below `min_form_share` of the cap."""

    max_entries: int = 0
    min_form_share: float = 0.05
    rebalance_every: int = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The Prometheus endpoint; an empty address turns it off."""

    address: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything `kvtier serve` runs on; `source` says where it came from."""

    device: str
    profiles: tuple[str, ...]
    server: ServerConfig
    pool: PoolConfig
    store: StoreSection
    verifier: VerifierConfig
    metrics: MetricsConfig
    admission: AdmissionSection = AdmissionSection()
    lease_ttl_s: float = 30.0
    recovering_cap: int = 4096  # slots RECOVERING at once; one lookup's queue loads as one batch
    recover_queue: int = 4096  # objects one lookup may queue for recovery; the rest RECOMPUTE `admission`
    persist_queue_depth: int = 1024
    shutdown_timeout_s: float = 20.0
    durable_wait_s: float = 30.0  # how long a durable offload waits for objects other connections are writing
    # per profile, version-key fields laid over the profile's own (weights_digest, kernel_abi, ...): a rollout
    versions: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    # per profile, the version-key fields of a canary served beside the live version (`<profile>@canary`)
    canary: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    # off (single node) unless a `[cluster]` table enables it
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    # off (no socket) unless `[events] endpoint` is set: the KV events a router subscribes to (docs/events.md)
    events: EventsConfig = dataclasses.field(default_factory=EventsConfig)
    mode: str = "user"  # whose defaults the file was laid over (MODES)
    source: str = "embedded default"
    mode_why: str = "the default"  # what chose the mode, for `config show` and `doctor`

    @property
    def file(self) -> str:
        """The config file read, or 'none' (only the mode's defaults)."""
        return "none" if self.source in ("embedded default", "systemd default") else self.source

    def to_dict(self) -> dict[str, Any]:
        """The effective config as TOML-able plain data (sizes in bytes, the socket mode as an octal string);
        `mode` is a key (the file says its own mode when read back), `mode_why` is not."""
        out = _plain(dataclasses.asdict(self))
        out["server"]["socket_mode"] = f"{self.server.socket_mode:04o}"
        del out["mode_why"]
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def embedded_default(cwd: Path | None = None) -> DaemonConfig:
    """The user mode's defaults: everything under ./.kvtier/, cpu, the ref-tiny profile, small budgets."""
    base = (cwd or Path.cwd()) / ".kvtier"
    return DaemonConfig(
        device="cpu",
        profiles=("ref-tiny",),
        server=ServerConfig(socket=base / SOCKET_NAME),
        pool=PoolConfig({f: 8 * 2**20 for f in FORMS}),
        store=StoreSection(root=base / "store", budget_bytes=1 * 2**30, quota_bytes={}),
        verifier=VerifierConfig(mode="supervise"),
        metrics=MetricsConfig(),
        mode="user",
        source="embedded default",
    )


def systemd_default(env: Mapping[str, str]) -> DaemonConfig:
    """The system mode's defaults: the socket in the runtime directory, the store in the state directory."""
    runtime = Path(env.get("RUNTIME_DIRECTORY", str(SYSTEMD_RUNTIME_DIR)).split(":")[0])
    state = Path(env.get("STATE_DIRECTORY", str(SYSTEMD_STATE_DIR)).split(":")[0])
    return DaemonConfig(
        device="auto",
        profiles=("deepseek-v4-flash",),
        # 0666 in a 0755 directory: every local user reaches the socket, and the daemon admits each peer by its
        # credentials (root, its own uid, server.allowed_uids / allowed_gids), so those lists can grant access
        server=ServerConfig(socket=runtime / SOCKET_NAME, socket_mode=0o666),
        pool=PoolConfig({f: 512 * 2**20 for f in FORMS}),
        store=StoreSection(root=state / "store", budget_bytes=100 * 2**30, quota_bytes={}),
        verifier=VerifierConfig(mode="external"),
        metrics=MetricsConfig(address="127.0.0.1:9641"),
        mode="system",
        source="systemd default",
    )


def mode_defaults(mode: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> DaemonConfig:
    """The defaults of a mode (MODES), before any file."""
    return systemd_default(os.environ if env is None else env) if mode == "system" else embedded_default(cwd)


def choose_mode(flag: str | None, file_mode: Any, env: Mapping[str, str], source: str | None = None) -> tuple[str, str]:
    """(mode, why): `--user`/`--system`, else the file's `mode` key, else $KVTIER_MODE, else the directories
    systemd sets for a unit, else user. Never the uid. A flag that contradicts the file is an error: which
    one was meant cannot be guessed."""
    if file_mode is not None and file_mode not in MODES:
        raise ConfigError(f"must be one of {', '.join(MODES)}; got {file_mode!r}", key="mode", source=source)
    if flag is not None:
        if file_mode is not None and file_mode != flag:
            raise ConfigError(
                f"says {file_mode!r} but --{flag} was given; drop the flag or change the key", key="mode", source=source
            )
        return flag, f"--{flag}"
    if file_mode is not None:
        return file_mode, f"the mode key of {source}"
    if value := env.get(MODE_ENV):
        if value not in MODES:
            raise ConfigError(f"${MODE_ENV} must be one of {', '.join(MODES)}; got {value!r}")
        return value, f"${MODE_ENV}={value}"
    for var in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY"):
        if var in env:
            return "system", f"systemd set ${var} for this unit"
    return "user", "the default: no --user/--system, no mode key, no $KVTIER_MODE"


def load_config(
    path: str | Path | None = None,
    *,
    mode: str | None = None,
    env: Mapping[str, str] | None = None,
    uid: int | None = None,  # accepted from older callers and ignored: the mode never follows the uid
    cwd: Path | None = None,
) -> DaemonConfig:
    """The effective config: `path` (in system mode, /etc/kvtier/kvtier.toml when no path is given and it
    exists) laid over the chosen mode's defaults. `mode` is the command line's --user/--system."""
    del uid
    env = os.environ if env is None else env
    if mode is not None and mode not in MODES:
        raise ConfigError(f"the mode must be one of {', '.join(MODES)}; got {mode!r}")
    data: dict[str, Any] | None = None
    if path is None:
        chosen, _ = choose_mode(mode, None, env)
        if chosen == "system" and SYSTEM_CONFIG.exists():
            path = SYSTEM_CONFIG
    source = str(path) if path is not None else None
    if path is not None:
        data = _read_toml(Path(path))
    file_mode = data.pop("mode", None) if data is not None else None
    chosen, why = choose_mode(mode, file_mode, env, source)
    base = mode_defaults(chosen, env, cwd)
    base = dataclasses.replace(base, mode_why=why)
    if data is None:
        return base
    return config_from_dict(data, base, str(path))


def _read_toml(path: Path) -> dict[str, Any]:
    source = str(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("no such config file; pass --config with an existing TOML file", source=source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read: {exc}", source=source) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", source=source) from None


def apply_reloadable(current: DaemonConfig, new: DaemonConfig) -> DaemonConfig:
    """What SIGHUP changes at run time: the store's byte budget and per-form quotas, the verifier's rates, and
    the profiles' version keys (`versions`: a new namespace goes live, the old one is retired; `canary`).

    Everything else (pools, device, profiles, socket, lease TTL, recovering cap) takes a restart.
    """
    return dataclasses.replace(
        current,
        store=dataclasses.replace(
            current.store, budget_bytes=new.store.budget_bytes, quota_bytes=new.store.quota_bytes
        ),
        verifier=dataclasses.replace(
            current.verifier,
            rate_bytes_per_s=new.verifier.rate_bytes_per_s,
            busy_rate_bytes_per_s=new.verifier.busy_rate_bytes_per_s,
            sweep_interval_s=new.verifier.sweep_interval_s,
        ),
        versions=new.versions,
        canary=new.canary,
    )


# ---------------------------------------------------------------------------------------------
# Parsing: every value is checked; every problem is a ConfigError naming its dotted key.


class _Reader:
    """Typed access to one TOML table; remembers which keys were read so leftovers are reported as unknown."""

    def __init__(self, table: Any, prefix: str, source: str) -> None:
        if not isinstance(table, dict):
            raise ConfigError("must be a table", key=prefix.rstrip(".") or None, source=source)
        self.table = table
        self.prefix = prefix
        self.source = source
        self.seen: set[str] = set()

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(message, key=f"{self.prefix}{key}", source=self.source)

    def get(self, key: str, default: Any) -> Any:
        self.seen.add(key)
        return self.table.get(key, default)

    def sub(self, key: str) -> _Reader:
        self.seen.add(key)
        return _Reader(self.table.get(key, {}), f"{self.prefix}{key}.", self.source)

    def string(
        self, key: str, default: str, pattern: re.Pattern[str] | None = None, choices: tuple[str, ...] = ()
    ) -> str:
        value = self.get(key, default)
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise self.error(key, f"invalid value {value!r}")
        if choices and value not in choices:
            raise self.error(key, f"must be one of {', '.join(choices)}; got {value!r}")
        return value

    def number(
        self, key: str, default: float, *, integer: bool = False, minimum: float = 0, allow_zero: bool = False
    ) -> Any:
        value = self.get(key, default)
        ok_types = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types):
            raise self.error(key, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
        if value < minimum or (value == 0 and not allow_zero):
            raise self.error(key, f"must be {'>=' if allow_zero else '>'} {minimum}, got {value}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def size(self, key: str, default: int) -> int:
        return parse_size(self.get(key, default), f"{self.prefix}{key}", self.source)

    def ids(self, key: str, default: tuple[int, ...]) -> tuple[int, ...]:
        value = self.get(key, list(default))
        if not isinstance(value, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
        ):
            raise self.error(key, f"must be a list of non-negative integers, got {value!r}")
        return tuple(value)

    def form_sizes(self, key: str, default: Mapping[str, int], *, complete: bool) -> dict[str, int]:
        sub = self.sub(key)
        out = dict(default)
        for form in FORMS:
            if form in sub.table or complete:
                out[form] = sub.size(form, default.get(form, 0))
        sub.finish()
        return out

    def finish(self) -> None:
        unknown = sorted(set(self.table) - self.seen)
        if unknown:
            raise self.error(unknown[0], "unknown key (misspelt? see `kvtier config show` for the known ones)")


def parse_size(value: Any, key: str, source: str | None = None) -> int:
    """Bytes from an integer or a string like '64MiB' / '1.5 GB'."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and (m := _SIZE.match(value)):
        return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    raise ConfigError(
        f"must be a byte size (an integer or a string like '64MiB'), got {value!r}", key=key, source=source
    )


def _socket_mode(value: Any, key: str, source: str) -> int:
    if isinstance(value, str) and re.fullmatch(r"0?[0-7]{3}", value):
        return int(value, 8)
    raise ConfigError(f"must be an octal string like '0660', got {value!r}", key=key, source=source)


def _path(reader: _Reader, key: str, default: Path) -> Path:
    value = reader.get(key, str(default))
    if not isinstance(value, str) or not value:
        raise reader.error(key, f"must be a non-empty path string, got {value!r}")
    return Path(value)


def _metrics_address(reader: _Reader, default: str) -> str:
    value = reader.string("address", default)
    if value and not re.fullmatch(r"[\w.\-\[\]:]*:\d{1,5}", value):
        raise reader.error("address", f"must be HOST:PORT or empty to disable, got {value!r}")
    if value and int(value.rpartition(":")[2]) > 65535:
        raise reader.error("address", f"port {value.rpartition(':')[2]} is out of range (0-65535), got {value!r}")
    return value


def _cluster(reader: _Reader, base: ClusterConfig) -> ClusterConfig:
    """The `[cluster]` table: each key read by the type of its default; ranges checked by ClusterConfig itself."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(ClusterConfig):
        key, default = field.name, getattr(base, field.name)
        if isinstance(default, bool):
            values[key] = reader.boolean(key, default)
        elif isinstance(default, WriteThrough):
            values[key] = WriteThrough(reader.string(key, default.value, choices=tuple(w.value for w in WriteThrough)))
        elif isinstance(default, int) and key.endswith("_bytes"):
            values[key] = reader.size(key, default)
        elif isinstance(default, int):
            values[key] = reader.number(key, default, integer=True, allow_zero=True)
        elif isinstance(default, float):
            values[key] = float(reader.number(key, default))
        else:
            values[key] = reader.string(key, default)
    reader.finish()
    try:
        return ClusterConfig(**values)
    except ConfigError as exc:  # ClusterConfig names the key; say which file too
        raise ConfigError(str(exc).removeprefix(f"key '{exc.key}': "), key=exc.key, source=reader.source) from None


VERSION_FIELDS = ("weights_digest", "kernel_abi", "compression_version", "indexer_version", "dtype_layout")


def _versions(reader: _Reader, profiles: tuple[str, ...]) -> dict[str, dict[str, str]]:
    """`[versions.<profile>]` / `[canary.<profile>]`: version-key fields that override the profile's own."""
    out: dict[str, dict[str, str]] = {}
    for name in list(reader.table):
        if name not in profiles:
            raise reader.error(name, f"not a served profile (profiles: {', '.join(profiles)})")
        sub = reader.sub(name)
        out[name] = {f: sub.string(f, "") for f in VERSION_FIELDS if f in sub.table}
        if any(not v for v in out[name].values()):
            raise sub.error(next(f for f, v in out[name].items() if not v), "must be a non-empty string")
        sub.finish()
    reader.finish()
    return out


def config_from_dict(data: dict[str, Any], base: DaemonConfig, source: str) -> DaemonConfig:
    """Lay a parsed TOML document over `base`; unknown keys and bad values are ConfigErrors naming the key."""
    top = _Reader(data, "", source)
    device = top.string("device", base.device, pattern=DEVICES)
    profiles = top.get("profiles", list(base.profiles))
    if not isinstance(profiles, list) or not profiles or not all(isinstance(p, str) and p for p in profiles):
        raise top.error("profiles", f"must be a non-empty list of profile names or paths, got {profiles!r}")

    s = top.sub("server")
    b = base.server
    server = ServerConfig(
        socket=_path(s, "socket", b.socket),
        socket_mode=_socket_mode(s.get("socket_mode", f"{b.socket_mode:04o}"), "server.socket_mode", source),
        allowed_uids=s.ids("allowed_uids", b.allowed_uids),
        allowed_gids=s.ids("allowed_gids", b.allowed_gids),
        max_frame_bytes=s.size("max_frame_bytes", b.max_frame_bytes),
        max_connections=s.number("max_connections", b.max_connections, integer=True, minimum=1),
        frame_timeout_s=float(s.number("frame_timeout_s", b.frame_timeout_s)),
        hello_timeout_s=float(s.number("hello_timeout_s", b.hello_timeout_s)),
        idle_timeout_s=float(s.number("idle_timeout_s", b.idle_timeout_s, allow_zero=True)),
        max_buffered_bytes=s.size("max_buffered_bytes", b.max_buffered_bytes),
    )
    if server.max_frame_bytes < 4096:
        raise s.error("max_frame_bytes", f"must be at least 4096, got {server.max_frame_bytes}")
    if server.max_buffered_bytes < server.max_frame_bytes:
        raise s.error(
            "max_buffered_bytes",
            f"must be at least max_frame_bytes ({server.max_frame_bytes}), got {server.max_buffered_bytes}",
        )
    s.finish()

    p = top.sub("pool")
    pool = PoolConfig(p.form_sizes("budget_bytes", base.pool.budget_bytes, complete=True))
    p.finish()

    st = top.sub("store")
    b2 = base.store
    store = StoreSection(
        root=_path(st, "root", b2.root),
        budget_bytes=st.size("budget_bytes", b2.budget_bytes),
        quota_bytes=st.form_sizes("quota_bytes", b2.quota_bytes, complete=False),
        io_threads=st.number("io_threads", b2.io_threads, integer=True, minimum=1),
        codec=st.string("codec", b2.codec, choices=("none", "zstd")),
        create=st.boolean("create", b2.create),
    )
    st.finish()

    v = top.sub("verifier")
    b3 = base.verifier
    verifier = VerifierConfig(
        mode=v.string("mode", b3.mode, choices=VERIFIER_MODES),
        rate_bytes_per_s=v.size("rate_bytes_per_s", b3.rate_bytes_per_s),
        busy_rate_bytes_per_s=v.size("busy_rate_bytes_per_s", b3.busy_rate_bytes_per_s),
        sweep_interval_s=float(v.number("sweep_interval_s", b3.sweep_interval_s)),
        restart_backoff_s=float(v.number("restart_backoff_s", b3.restart_backoff_s)),
        max_backoff_s=float(v.number("max_backoff_s", b3.max_backoff_s)),
        hung_after_s=float(v.number("hung_after_s", b3.hung_after_s)),
    )
    v.finish()

    m = top.sub("metrics")
    metrics = MetricsConfig(_metrics_address(m, base.metrics.address))
    m.finish()

    a = top.sub("admission")
    b4 = base.admission
    admission = AdmissionSection(
        max_entries=a.number("max_entries", b4.max_entries, integer=True, allow_zero=True),
        min_form_share=float(a.number("min_form_share", b4.min_form_share, allow_zero=True)),
        rebalance_every=a.number("rebalance_every", b4.rebalance_every, integer=True, minimum=1),
    )
    if admission.min_form_share > 1:
        raise a.error("min_form_share", f"must be at most 1, got {admission.min_form_share}")
    a.finish()

    cfg = DaemonConfig(
        device=device,
        profiles=tuple(profiles),
        server=server,
        pool=pool,
        store=store,
        verifier=verifier,
        metrics=metrics,
        admission=admission,
        lease_ttl_s=float(top.number("lease_ttl_s", base.lease_ttl_s)),
        recovering_cap=top.number("recovering_cap", base.recovering_cap, integer=True, minimum=1),
        recover_queue=top.number("recover_queue", base.recover_queue, integer=True, minimum=1),
        persist_queue_depth=top.number("persist_queue_depth", base.persist_queue_depth, integer=True, minimum=1),
        shutdown_timeout_s=float(top.number("shutdown_timeout_s", base.shutdown_timeout_s)),
        durable_wait_s=float(top.number("durable_wait_s", base.durable_wait_s)),
        versions=_versions(top.sub("versions"), tuple(profiles)),
        canary=_versions(top.sub("canary"), tuple(profiles)),
        cluster=_cluster(top.sub("cluster"), base.cluster),
        events=parse_events(top.get("events", {}), base.events, source),
        mode=base.mode,
        source=source,
        mode_why=base.mode_why,
    )
    top.finish()
    return cfg
